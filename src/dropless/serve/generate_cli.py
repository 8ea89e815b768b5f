"""`dropless generate`: sample text from a trained run (its latest checkpoint), with the KV cache of
serve/generate.py.

    dropless generate --run-dir DIR --prompt TEXT [--prompt TEXT2 ...] [--prompts-file F]
        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--repetition-penalty R]
        [--stop STR ...] [--seed S] [--device auto|cpu|cuda] [--dtype fp32|bf16] [--no-cache]
        [--record-routing FILE] [--serve-top-k K1 [--serve-norm-top-k K2] [--serve-renorm mass|kept]]

One prompt streams its tokens to stdout as they come; a batch prints each sequence when all are done.
Bad flags are reported before the run is loaded (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..data.tokenizer import load_tokenizer
from ..device import resolve_device
from ..hf.load_run import load_model
from ..model import MoEModel
from .generate import GenerateResult, generate
from .sampling import Sampling
from .serving import add_serving_args, serving_map_from_args


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ValueError(f"--prompts-file={args.prompts_file!r}: no such file")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line]
    return prompts or [""]


class _Printer:
    """Streams one sequence's text to stdout, holding back an incomplete UTF-8 character (the byte
    tokenizer emits a multi-byte character one byte at a time)."""

    def __init__(self, tok: object, prompt: str) -> None:
        self.tok, self.prompt, self.ids, self.shown = tok, prompt, [], 0

    def __call__(self, _seq: int, token: int) -> None:
        if self.prompt is not None:  # echoed once the generation is under way (no error after it)
            sys.stdout.write(self.prompt)
            self.prompt = None
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[self.shown:])
            sys.stdout.flush()
            self.shown = len(text)

    def flush(self) -> None:
        sys.stdout.write((self.prompt or "") + self.tok.decode(self.ids)[self.shown:] + "\n")


def _write_record(args: argparse.Namespace, model: MoEModel, texts: list[str], tok: object,
                  result: GenerateResult) -> None:
    """The routing record of a generation: per sequence its tokens (prompt as fed + generated, stop
    string cut) and the ids of every one of them (written atomically by RoutingRecord.save)."""
    from .record_routing import checkpoint_step
    from ..data.routing_record import RoutingRecord

    seqs = [(tok.encode(t) or [0]) + ids for t, ids in zip(texts, result.tokens)]
    try:
        step = checkpoint_step(args.run_dir)
    except (ValueError, FileNotFoundError):
        step = None
    source = f"{'recompute' if args.no_cache else 'kv-cache'} decode {args.dtype}"
    RoutingRecord.for_model(model, seqs, result.routing, source, args.run_dir, step).save(args.record_routing)
    print(f"routing of {len(seqs)} sequences written to {args.record_routing}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless generate", description="Sample text from a trained run "
                                "(latest checkpoint), with a KV cache.")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", help="one prompt per non-empty line, added after --prompt ones")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40, help="0 = off")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", help="stop string, cut from the output (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16 (autocast; the router stays fp32)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context every token")
    p.add_argument("--record-routing", metavar="FILE", help="write every token's expert ids, per MoE "
                   "layer, as a routing record (data/routing_record.py)")
    add_serving_args(p)
    args = p.parse_args(argv)
    try:
        serve_map = serving_map_from_args(args)  # flag-only errors before anything is loaded
        if args.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device={args.device!r}: must be one of auto, cpu, cuda")
        if args.dtype not in ("fp32", "bf16"):
            raise ValueError(f"--dtype={args.dtype!r}: must be fp32 or bf16")
        if args.record_routing is not None and not Path(args.record_routing).parent.is_dir():
            raise ValueError(f"--record-routing={args.record_routing!r}: its directory does not exist")
        top_k = None if args.top_k == 0 else args.top_k
        Sampling(args.temperature, top_k, args.top_p, args.repetition_penalty)  # before loading
        device = resolve_device(args.device)[0]
        model, cfg = load_model(args.run_dir, device, model_cfg=serve_map)
        tok = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
        texts = _read_prompts(args)
        printer = _Printer(tok, texts[0]) if len(texts) == 1 else None
        result = generate(model, [tok.encode(t) for t in texts], args.max_new_tokens,
                          temperature=args.temperature, top_k=top_k, top_p=args.top_p,
                          repetition_penalty=args.repetition_penalty, stop=args.stop, tokenizer=tok,
                          seed=args.seed, use_cache=not args.no_cache, on_token=printer, dtype=args.dtype,
                          record_routing=args.record_routing is not None)
        if args.record_routing is not None:
            _write_record(args, model, texts, tok, result)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless generate: error: {err}", file=sys.stderr)
        return 2
    if printer is not None:
        printer.flush()
    else:
        for i, (text, ids) in enumerate(zip(texts, result.tokens)):
            print(f"--- [{i}] ({result.finish[i]})\n{text}{tok.decode(ids)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
