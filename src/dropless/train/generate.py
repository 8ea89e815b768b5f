"""`dropless generate`: sample text from a trained run's latest checkpoint.

    dropless generate --run-dir DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
                      [--device auto|cpu|cuda]

Sampling recomputes the (cropped) context each token: simple and exact for the small models trained
here; a KV cache is what long generations need. The model runs in fp32 on `--device` ("auto": CUDA
when present), whatever device trained it; sampling draws from a generator on that device.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..model import MoEModel
from ..serve.load import load_model
from .device import resolve_device
from .tokenizer import load_tokenizer


@torch.no_grad()
def sample(model: MoEModel, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, generator: torch.Generator | None = None) -> list[int]:
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: must be >= 1")
    ids = torch.tensor([prompt_ids or [0]], dtype=torch.long, device=model.embed.weight.device)
    for _ in range(max_new_tokens):
        ctx = ids[:, -model.cfg.max_seq_len:]
        logits = model(ctx).logits[0, -1].float()
        if temperature == 0:
            nxt = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = logits.topk(min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids or [0]):].tolist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless generate", description="Sample from a trained run.")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args(argv)
    try:
        device = resolve_device(args.device)[0]
        model, cfg = load_model(args.run_dir, device)
        tok = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
        out = sample(model, tok.encode(args.prompt), args.max_new_tokens, args.temperature, args.top_k,
                     torch.Generator(device).manual_seed(args.seed))
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless generate: error: {err}", file=sys.stderr)
        return 2
    print(args.prompt + tok.decode(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
