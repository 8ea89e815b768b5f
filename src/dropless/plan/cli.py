"""`dropless plan`: predict the memory of a training run per rank before launching it.

    dropless plan CONFIG [--world N] [--set a.b=value ...] [--device-memory 80GiB]
                  [--micro-batch-tokens N] [--pipeline P] [--json FILE]

CONFIG is what `dropless train --config` takes: a preset name (`tiny`, `dense`) or a TOML file.
Prints the bytes per rank of each component (model.py's note says what each counts), the peak,
whether it fits the device memory, and, when it does not (or is within 10% of it), each knob's
predicted peak (suggest.py). `--json` writes the same as one object. The host bytes that
`model.offload` holds are a component of their own (`offload_host`), not in the device peak.

`--micro-batch-tokens N` sets the tokens per micro-batch per rank (train.batch_size = N / seq_len).
`--pipeline P` is `--set parallel.pp_size=P`: pipeline stages, planned rank by rank (model.py,
pipeline.py: each rank's stages, its schedule's micro-batches in flight, the embedding on the first
stage and the head and loss on the last); the table is the rank with the highest peak, and a line
per pipeline rank follows it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

from .. import atomic
from ..config import RunConfig, load_config
from .model import COMPONENTS, Plan, plan, plan_ranks, with_overrides
from .suggest import Suggestion, suggest

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
GIB = 2**30


def parse_bytes(flag: str, text: str) -> int:
    """'80GiB' (binary), '80GB' (decimal), '123' or '123B' (bytes), spelled exactly so ('80gb' and
    '80Gb', bits, are refused); a ValueError names the flag."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2) if m else None
    if not m or unit not in UNITS:
        raise ValueError(f"{flag} {text!r}: expected a size such as 80GiB, 80GB or a number of bytes "
                         f"(units: {', '.join(u for u in UNITS if u)})")
    value = float(m.group(1)) * UNITS[unit]
    if value <= 0 or value != int(value):
        raise ValueError(f"{flag} {text!r}: must be a positive whole number of bytes")
    return int(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dropless plan", description="Predict per-rank training memory.")
    p.add_argument("config", help="preset name or TOML file (as dropless train --config)")
    p.add_argument("--world", type=int, default=1, help="ranks (processes) in the run (default 1)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value",
                   help="override a config field by dotted name (repeatable)")
    p.add_argument("--device-memory", default="80GiB", help="memory of one device (default 80GiB)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="tokens per micro-batch per rank (sets train.batch_size = N / train.seq_len)")
    p.add_argument("--pipeline", type=int, default=None,
                   help="pipeline ranks: the same as --set parallel.pp_size=P (module note)")
    p.add_argument("--json", default=None, help="also write the plan as JSON to this file")
    return p


def build(args: argparse.Namespace) -> tuple[RunConfig, int, int]:
    from ..runs.presets import PRESETS, preset_path
    device = parse_bytes("--device-memory", args.device_memory)
    if args.world < 1:
        raise ValueError(f"--world {args.world}: must be >= 1")
    if args.pipeline is not None and (args.pipeline < 1 or args.world % args.pipeline):
        raise ValueError(f"--pipeline {args.pipeline}: must be >= 1 and divide --world {args.world}")
    if args.json and not Path(args.json).resolve().parent.is_dir():  # refused before the plan, not after
        raise ValueError(f"--json {args.json}: its folder does not exist")
    try:
        path = preset_path(args.config)
    except (ValueError, FileNotFoundError) as e:  # its message names train's flag; here it is CONFIG
        msg = str(e).replace("--config", "CONFIG", 1)
        if isinstance(e, ValueError):  # the recipes of published runs are presets of plan's too
            recipes = sorted(f"plan/{q.stem}" for q in (PRESETS / "plan").glob("*.toml"))
            msg += f"; plan recipes: {', '.join(recipes)}"
        raise type(e)(msg) from None
    pipeline = [] if args.pipeline is None else [f"parallel.pp_size={args.pipeline}"]
    try:
        cfg = load_config(path, [*args.overrides, *pipeline])
    except ValueError as e:
        if pipeline and "parallel.pp_size" in str(e):  # say which flag set it
            raise ValueError(f"--pipeline {args.pipeline}: {e}") from None
        raise
    if args.micro_batch_tokens is not None:
        n, s = args.micro_batch_tokens, cfg.train.seq_len
        if n < s or n % s:
            raise ValueError(f"--micro-batch-tokens {n}: must be a positive multiple of train.seq_len={s}")
        cfg = with_overrides(cfg, [f"train.batch_size={n // s}"])
    pp, ep = cfg.parallel.pp_size, cfg.parallel.ep_size
    if args.world % pp or (args.world // pp) % ep:
        raise ValueError(f"--world {args.world}: must be a multiple of parallel.ep_size={ep}"
                         + (f" x parallel.pp_size={pp}" if pp > 1 else ""))
    return cfg, device


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:,.2f}"


def _pipeline_lines(cfg: RunConfig, p: Plan, ranks: list[Plan], device: int) -> list[str]:
    spec = cfg.parallel.pipeline
    lines = [f"pipeline: {spec.pp_size} ranks, {spec.num_stages} stages, schedule {spec.schedule}, "
             f"{spec.microbatches} micro-batches per call; the table is pp rank {p.pp_rank} (the highest peak)",
             f"{'pp rank':>7}  {'stages':<10} {'blocks':>6}  {'in flight (stage: micro-batches)':<34} "
             f"{'activations GiB':>15} {'peak GiB':>9}"]
    for r in ranks:
        flight = ", ".join(f"{s}: {n}" for s, n in r.in_flight)
        lines.append(f"{r.pp_rank:>7}  {','.join(map(str, r.stages)):<10} {r.blocks:>6}  {flight:<34} "
                     f"{_gib(r.activations):>15} {_gib(r.peak):>9}{'' if r.peak <= device else '  does NOT fit'}")
    return lines


def report(name: str, cfg: RunConfig, world: int, device: int, p: Plan, shown: list[Suggestion],
           combined: Suggestion | None, ranks: list[Plan] = ()) -> str:
    a = p.activation_detail
    pp = cfg.parallel.pp_size
    lines = [f"dropless plan: {name}, world {world} (" + (f"pp {pp} x " if pp > 1 else "")
             + f"ep {p.ep_size}, {world // pp // p.ep_size} expert-data-parallel), {p.tokens} tokens per "
             f"micro-batch per rank, {'bf16' if p.bf16 else 'fp32'}",
             "", f"{'component':<13} {'bytes per rank':>18} {'GiB':>10}"]
    for c in COMPONENTS:
        note = "  host memory, not in the peak" if c == "offload_host" else ""
        lines.append(f"{c:<13} {getattr(p, c):>18,} {_gib(getattr(p, c)):>10}{note}")
    lines.append(f"{'peak':<13} {p.peak:>18,} {_gib(p.peak):>10}")
    lines += ["", f"activations per micro-batch: head {a.head:,} B; dense block {a.dense_block:,} B x {a.n_dense}; "
              f"MoE block {a.moe_block:,} B x {a.n_moe}; {a.per_token:,.0f} B/token"
              + ("; blocks measured one by one (train.lora), the largest of each kind shown" if a.per_block else ""),
              f"recompute: {cfg.model.recompute or 'none'}; offload: {cfg.model.offload or 'none'}; "
              f"optimizer: {cfg.train.optimizer}"]
    lo = cfg.train.lora
    if lo.enabled:
        lines.append(f"train.lora: rank {lo.rank}, base {lo.base}: params = {p.params - p.frozen:,} B trainable "
                     f"(fp32; grads and optimizer state for these only) + {p.frozen:,} B frozen base")
    if ranks:
        lines += ["", *_pipeline_lines(cfg, p, ranks, device)]
    fits = p.peak <= device
    lines.append(f"device memory {device:,} B ({_gib(device)} GiB): {'fits' if fits else 'does NOT fit'} "
                 f"(peak {100 * p.peak / device:.1f}%)")
    if shown:
        lines += ["", "knobs (each alone; predicted peak):"]
        for s in shown:
            what = " ".join(f"--set '{o}'" for o in s.overrides)
            verdict = f"refused: {s.refused}" if s.peak is None else (
                f"{_gib(s.peak)} GiB {'fits' if s.fits else 'does not fit'}"
                + (f" (+{_gib(s.host)} GiB host)" if s.host else ""))
            lines.append(f"  {s.knob:<13} {what:<60} {verdict}")
    if combined is not None:
        what = " ".join(f"--set '{o}'" for o in combined.overrides)
        lines.append(f"  combined: {what} -> {_gib(combined.peak)} GiB "
                     f"{'fits' if combined.fits else 'still does not fit'}"
                     + (f" (+{_gib(combined.host)} GiB host)" if combined.host else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg, device = build(args)
        ranks = plan_ranks(cfg, args.world) if cfg.parallel.pp_size > 1 else []
        p = max(ranks, key=lambda r: r.peak) if ranks else plan(cfg, args.world)
        shown, combined = [], None
        if p.peak > 0.9 * device:
            shown, combined = suggest(cfg, args.world, device)
    except (ValueError, FileNotFoundError) as e:
        print(f"dropless plan: error: {e}", file=sys.stderr)
        return 2
    print(report(args.config, cfg, args.world, device, p, shown, combined, ranks))
    if args.json:
        data = {"config": args.config, "world": args.world, "device_memory": device, "fits": p.peak <= device,
                "overrides": args.overrides, "plan": p.as_dict(), "pipeline_ranks": [r.as_dict() for r in ranks],
                "suggestions": [vars(s) for s in shown], "combined": vars(combined) if combined else None}
        atomic.write_text(args.json, json.dumps(data, indent=1, default=list))
    return 0
