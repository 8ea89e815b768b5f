"""`dropless bench generate`: prefill and decode speed with and without the KV cache, and the two MoE
paths of a decode step.

    dropless bench generate [--run-dir RUN | --config PRESET] [--device auto|cpu|cuda]
        [--dtype fp32|bf16] [--contexts 128,512,1024] [--batch 1] [--path-batches 1,2,4,8,16,64]
        [--repeats N] [--threads N] [--json FILE]

Legend: B sequences decoded together, C context (tokens already in the sequence).

The model: a run's latest checkpoint (`--run-dir`), or a preset with random weights (`--config`,
default "tiny"; speed does not depend on the weights, only on the routing's balance, which random
weights keep near uniform). Contexts past the model's max_seq_len are allowed here: the model is built
with max_seq_len = max(contexts) + 1. The rotary tables are buffers computed from max_seq_len, not
parameters, so a run's weights load into the longer model unchanged; positions past the trained
length give meaningless text but the same work per token, which is what is timed.

Per context C, timed in turns (bench/timing.py: medians, a device sync around each call):
- prefill: one forward of B x C tokens into an empty cache; tokens/s = B*C / time.
- decode, cache: a step at context C (B new tokens attending to C cached ones), timed as a run of
  8 consecutive steps from C (the cache rewound to C before each run) divided by 8: consecutive, as
  in generation, so a step meets the weights in the CPU caches where the previous step left them,
  not evicted by the interleaved no-cache forward; tokens/s = B / time per step.
- decode, no cache: what a step costs without the cache, a full forward of B x (C+1) tokens for the
  next token; tokens/s = B / time. `speedup` = its time / the cached step's.
Each step includes the greedy pick (argmax on the device) and no host read: sampling's cost is the
same for both and `generate` reads the tokens on the host only when it streams or checks stops.

MoE paths (layers/decode_experts.py): the same decode step at context 128 for each batch size in
--path-batches, with every MoE layer forced to the grouped path and to the decode path, in turns;
`auto` is what the layer picks by itself for that token count on this device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from .. import atomic
from ..config import load_config
from ..layers import decode_experts
from ..layers.kv_cache import KVCache
from ..model import MoEModel
from ..serve.evaluate import autocast
from ..hf.load_run import load_model
from ..device import resolve_device
from ..runs.presets import preset_path
from .timing import cpu_flags, format_table, interleaved

PATH_CONTEXT = 128
# cached decode steps per timed call (the figure is per step): consecutive steps, as in generation,
# so a step finds the weights where the previous one left them in the CPU caches, not where the
# interleaved no-cache forward (megabytes of activations) did
RUN = 8




def _ints(flag: str, text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag}={text!r}: must be a comma-separated list of positive integers")
    return vals


def build_model(args: argparse.Namespace, device: torch.device, max_len: int) -> tuple[MoEModel, str]:
    def longer(m):  # rotary tables are buffers: the checkpoint's tensors fit any max_seq_len
        return dataclasses.replace(m, max_seq_len=max(m.max_seq_len, max_len))

    if args.run_dir is not None:
        model, _ = load_model(args.run_dir, device, model_cfg=longer)
        return model, f"run {args.run_dir}"
    cfg = load_config(preset_path(args.config))
    torch.manual_seed(0)
    return MoEModel(longer(cfg.model)).to(device).eval(), f"preset {args.config} (random weights)"


def _step_fns(model: MoEModel, B: int, C: int, device: torch.device) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(C)
    ctx = torch.randint(0, model.cfg.vocab_size, (B, C + 1), generator=g).to(device)
    cache = KVCache.for_model(model, B, C + RUN)
    model(ctx[:, :C], cache=cache)  # the context the cached steps attend to

    def prefill() -> object:
        return model(ctx[:, :C], cache=KVCache.for_model(model, B, C)).logits[:, -1].argmax(-1)

    def decode_cache() -> object:
        cache.truncate(C)
        nxt = ctx[:, C:]
        for _ in range(RUN):  # each step feeds the previous step's pick, as generation does
            nxt = model(nxt, cache=cache).logits[:, -1:].argmax(-1)
        return nxt

    def decode_nocache() -> object:
        return model(ctx).logits[:, -1].argmax(-1)

    return {"prefill": prefill, "decode_cache": decode_cache, "decode_nocache": decode_nocache}


def _set_path(model: MoEModel, max_tokens: int | None) -> Callable[[], None]:
    def set_() -> None:
        for layer in model.moe_layers():
            layer.decode_max_tokens = max_tokens
    return set_


def run(model: MoEModel, contexts: list[int], B: int, path_batches: list[int], repeats: int,
        device: torch.device, dtype: str) -> tuple[list[dict], list[dict]]:
    rows, paths = [], []
    bar = tqdm(total=len(contexts) + (len(path_batches) if dtype == "fp32" else 0), desc="bench generate",
               file=sys.stderr)
    with torch.inference_mode(), autocast(device, dtype):
        for C in contexts:
            fns = _step_fns(model, B, C, device)
            ms = interleaved(fns, repeats, warmup=1, device=device)
            ms["decode_cache"] /= RUN
            rows.append({"context": C, "batch": B, "prefill_ms": ms["prefill"],
                         "prefill_tok_s": B * C / ms["prefill"] * 1e3,
                         "decode_cache_ms": ms["decode_cache"], "decode_cache_tok_s": B / ms["decode_cache"] * 1e3,
                         "decode_nocache_ms": ms["decode_nocache"],
                         "decode_nocache_tok_s": B / ms["decode_nocache"] * 1e3,
                         "speedup": ms["decode_nocache"] / ms["decode_cache"]})
            bar.update()
        # the decode path steps aside under autocast (layers/decode_experts.py): both columns would
        # time the grouped path, so there is no path table for a bf16 run
        for b in (path_batches if dtype == "fp32" else []):
            step = _step_fns(model, b, PATH_CONTEXT, device)["decode_cache"]
            variants = {}
            for name, max_tokens in (("grouped", 0), ("decode", b)):
                set_ = _set_path(model, max_tokens)
                variants[name] = (lambda s=set_: (s(), step()))
            ms = {k: v / RUN for k, v in interleaved(variants, repeats, warmup=1, device=device).items()}
            auto = "decode" if b <= decode_experts.default_max_tokens(device) else "grouped"
            paths.append({"batch": b, "context": PATH_CONTEXT, "grouped_ms": ms["grouped"],
                          "decode_ms": ms["decode"], "decode_speedup": ms["grouped"] / ms["decode"],
                          "auto": auto})
            bar.update()
        _set_path(model, None)()
    bar.close()
    return rows, paths


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dropless bench generate", description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", help="a trained run (its latest checkpoint)")
    ap.add_argument("--config", default="tiny", help="preset or TOML when no --run-dir (random weights)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--dtype", default="fp32", help="fp32 | bf16 (autocast)")
    ap.add_argument("--contexts", default="128,512,1024")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (context table)")
    ap.add_argument("--path-batches", default="1,2,4,8,16,64", help="batch sizes of the MoE path table")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    try:
        contexts = _ints("--contexts", args.contexts)
        path_batches = _ints("--path-batches", args.path_batches)
        if args.batch < 1:
            raise ValueError(f"--batch={args.batch}: must be >= 1")
        if args.repeats < 1:
            raise ValueError(f"--repeats={args.repeats}: must be >= 1")
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads={args.threads}: must be >= 1")
        if args.dtype not in ("fp32", "bf16"):
            raise ValueError(f"--dtype={args.dtype!r}: must be fp32 or bf16")
        if args.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device={args.device!r}: must be one of auto, cpu, cuda")
        device = resolve_device(args.device)[0]
        if args.threads:
            torch.set_num_threads(args.threads)
        model, source = build_model(args, device, max(contexts + [PATH_CONTEXT]) + RUN)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless bench generate: error: {err}", file=sys.stderr)
        return 2
    rows, paths = run(model, contexts, args.batch, path_batches, args.repeats, device, args.dtype)
    c = model.cfg
    where = (f"device={torch.cuda.get_device_name(device)}" if device.type == "cuda"
             else f"cpu threads={torch.get_num_threads()} flags: {cpu_flags()}")
    head = (f"generate bench: {source}, d={c.d_model} layers={c.n_layers} E={c.moe.num_experts} "
            f"k={c.moe.top_k}, dtype={args.dtype}, {where}, median of {args.repeats}")
    print(head)
    print(format_table(rows, ["context", "batch", "prefill_tok_s", "decode_cache_tok_s",
                              "decode_nocache_tok_s", "decode_cache_ms", "decode_nocache_ms", "speedup"]))
    if paths:
        print(f"\nMoE path of a decode step (context {PATH_CONTEXT}), ms per step:")
        print(format_table(paths, ["batch", "grouped_ms", "decode_ms", "decode_speedup", "auto"]))
    else:
        print(f"\nno MoE path table under --dtype {args.dtype}: the decode path steps aside under "
              "autocast (layers/decode_experts.py), so both paths would be the grouped one")
    if args.json:
        atomic.write_text(args.json, json.dumps({"header": head, "contexts": rows, "moe_paths": paths,
                                                 "torch": torch.__version__}, indent=1))
    return 0
