"""`dropless bench precision`: train the same model once per expert precision and compare.

    dropless bench precision [--config tiny] [--steps N] [--precisions bf16,mxfp8,...]
                             [--set a.b=value ...] [--out DIR] [--json FILE]
                             [--time-repeats R] [--skip-train]

Design note
-----------
The question a low-precision recipe must answer is what it does to the *trained* model, which a
single-layer error (tests/ops/test_quant_gemm.py) cannot tell: noise that looks large in one random
layer can average out over training, or compound. So this benchmark trains the preset (default corpus,
same seed, same batches, same initial weights: `moe.precision` changes no parameter) once per
precision, each in its own run directory under `--out`, and reports the final validation loss and its
gap to bf16 (`rel_to_bf16 = val_loss / bf16 val_loss - 1`).

`--steps N` shortens the run: the preset's warmup_steps, eval_every and ckpt_every are scaled by
N / preset steps, so the schedule keeps its shape (a 150-step run of a 600-step preset warms up for
a quarter as long and decays to the same min_lr). `--set` overrides are applied after the scaling.

Timing. A whole training run cannot be interleaved with another, and on a shared machine the load
changes between runs (on the shared 2-core machine of docs/low_precision.md, one fp8_blockwise step
took 0.7 s during its training run and 25 s in a test minutes later), so a step time taken during training says little about the precision. After the training
runs, the step time is therefore measured separately and interleaved: a fresh trainer per precision
(same model and batch shape, a small slice of the corpus, which does not change the cost of a step)
takes `Trainer.train_step` (forward, backward, optimizer) in turns, one step of every precision, then
the next, `--time-repeats` times after one warm-up round; `step_ms` is the median. `run_step_ms`, the
median step time during the precision's own training run, is kept for reference. `--skip-train` runs
the timing alone. Every low precision is emulated (`ops/quant_gemm.py`), so step times measure the
cost of the emulation, never the speed of a low-precision kernel.

The optimizer-state line compares `train.optimizer = adamw` with `adamw_bf16` (moments in bf16) on
the preset's model: `optim_lowp.state_bytes` after one optimizer step of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..config import PRECISIONS, RunConfig, load_config
from ..model import MoEModel
from ..train.optim import build_optimizer
from ..train.optim_lowp import state_bytes
from ..runs.presets import preset_path
from .timing import format_table, interleaved

BASELINE = "bf16"
# Fields scaled with --steps (they count steps); everything else is the preset's.
SCALED = ("warmup_steps", "eval_every", "ckpt_every")
QUIET = ["log.tensorboard=false", "log.plots=false"]
TIMING_CORPUS_BYTES = 2_000_000  # the timing trainers' corpus slice: batches cost the same from any corpus
COLUMNS = ["precision", "val_loss", "rel_to_bf16", "step_ms", "step_ms_rel_to_bf16", "run_step_ms",
           "train_loss"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dropless bench precision",
                                description="Train the preset once per expert precision; compare val loss "
                                            "and step time with bf16 (training runs back to back; step times interleaved).")
    p.add_argument("--config", default="tiny", help="preset name or TOML file (default: tiny)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's); "
                   "warmup_steps, eval_every, ckpt_every are scaled to match")
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help=f"comma-separated subset of {','.join(PRECISIONS)} (default: all)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value",
                   help="override a config field by dotted name (repeatable; applied after scaling)")
    p.add_argument("--out", default=None, help="folder for the run directories "
                   "(default: runs/bench-precision-<time>)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows to FILE as JSON")
    p.add_argument("--time-repeats", type=int, default=3,
                   help="interleaved timing rounds after training (default 3; 0 = no timing)")
    p.add_argument("--skip-train", action="store_true", help="only the interleaved step timing")
    return p


def scaled_overrides(base: RunConfig, steps: int) -> list[str]:
    """Overrides that shorten (or lengthen) the preset to `steps`, keeping the schedule's shape."""
    t = base.train
    out = [f"train.steps={steps}"]
    for name in SCALED:
        value = getattr(t, name)
        scaled = round(value * steps / t.steps)
        out.append(f"train.{name}={max(scaled, 0 if name == 'warmup_steps' else 1)}")
    return out


def build_configs(preset: Path, precisions: list[str], steps: int | None,
                  overrides: list[str]) -> dict[str, RunConfig]:
    base = load_config(preset, QUIET + overrides)
    scaling = scaled_overrides(base, steps) if steps is not None else []
    return {p: load_config(preset, QUIET + scaling + overrides + [f"model.moe.precision={p}"])
            for p in precisions}


def optimizer_state_bytes(cfg: RunConfig) -> dict[str, int]:
    """state_bytes after one step of each optimizer on the model of `cfg` (gradients all ones: the state's
    size depends only on which parameters have a gradient, and every parameter has one in training)."""
    out = {}
    for name in ("adamw", "adamw_bf16"):
        torch.manual_seed(cfg.train.seed)
        model = MoEModel(cfg.model)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt = build_optimizer(model, dataclasses.replace(cfg.train, optimizer=name))
        opt.step()
        out[name] = state_bytes(opt)
    return out


def train_one(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    """Train to the end; return the summary plus the median train_step time in ms during the run."""
    from ..train.loop import Trainer
    from ..runs.sinks import read_jsonl

    summary = Trainer(cfg, run_dir).fit()
    times_ms = [r["step_ms"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "step_ms" in r]
    summary["run_step_ms"] = statistics.median(times_ms[1:] or times_ms)
    return summary


def time_steps(configs: dict[str, RunConfig], out: Path, repeats: int) -> dict[str, float]:
    """Median ms of one `train_step` per precision, interleaved (see the module note)."""
    from ..train.loop import Trainer

    trainers = {}
    for p, cfg in configs.items():
        max_bytes = min(cfg.data.max_bytes or TIMING_CORPUS_BYTES, TIMING_CORPUS_BYTES)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_bytes=max_bytes))
        trainers[p] = Trainer(cfg, out / "timing" / p)
    counter = {p: 0 for p in trainers}

    def step_of(p: str):
        def run() -> None:
            trainers[p].train_step(counter[p])
            counter[p] += 1
        return run

    def progress(rep: int) -> None:
        print(f"timing round {rep + 1}/{repeats}", file=sys.stderr, flush=True)

    return interleaved({p: step_of(p) for p in trainers}, repeats=repeats, warmup=1, progress=progress)


def compare(precisions: list[str], results: dict[str, dict[str, Any]],
            step_ms: dict[str, float]) -> list[dict[str, Any]]:
    def ratio(a: float | None, b: float | None, minus: float) -> float | None:
        return None if a is None or b is None else a / b - minus

    base = results.get(BASELINE, {})
    rows = []
    for p in precisions:
        s = results.get(p, {})
        rows.append({"precision": p, "val_loss": s.get("final_val_loss"), "train_loss": s.get("final_train_loss"),
                     "rel_to_bf16": ratio(s.get("final_val_loss"), base.get("final_val_loss"), 1.0),
                     "step_ms": step_ms.get(p),
                     "step_ms_rel_to_bf16": ratio(step_ms.get(p), step_ms.get(BASELINE), 0.0),
                     "run_step_ms": s.get("run_step_ms")})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    precisions = list(dict.fromkeys(p.strip() for p in args.precisions.split(",") if p.strip()))
    try:
        bad = [p for p in precisions if p not in PRECISIONS]
        if bad or not precisions:
            raise ValueError(f"--precisions {args.precisions!r}: choose from {', '.join(PRECISIONS)}")
        if args.steps is not None and args.steps < 1:
            raise ValueError(f"--steps {args.steps}: must be a positive integer")
        if args.time_repeats < 0 or (args.skip_train and args.time_repeats == 0):
            raise ValueError(f"--time-repeats {args.time_repeats}: must be >= 0 (> 0 with --skip-train)")
        preset = preset_path(args.config)
        configs = build_configs(preset, precisions, args.steps, args.overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless bench precision: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/bench-precision-{time.strftime('%Y%m%d-%H%M%S')}")
    first = next(iter(configs.values()))
    t = first.train
    print(f"preset {preset.stem}: {t.steps} steps x {t.batch_size * t.seq_len * t.grad_accum} tokens, "
          f"warmup {t.warmup_steps}, eval_every {t.eval_every}, threads {torch.get_num_threads()}; "
          f"runs under {out}", file=sys.stderr, flush=True)

    results: dict[str, dict[str, Any]] = {}
    for i, (p, cfg) in enumerate(configs.items() if not args.skip_train else ()):
        print(f"[{i + 1}/{len(configs)}] moe.precision={p}", file=sys.stderr, flush=True)
        results[p] = train_one(cfg, out / p)
        print(f"[{i + 1}/{len(configs)}] {p}: val_loss {results[p]['final_val_loss']:.4f}, "
              f"step {results[p]['run_step_ms']:.0f} ms (in run)", file=sys.stderr, flush=True)
    step_ms = time_steps(configs, out, args.time_repeats) if args.time_repeats else {}

    rows = compare(precisions, results, step_ms)
    state = optimizer_state_bytes(first)
    print(f"dropless bench precision: preset {preset.stem}, {t.steps} steps, "
          f"{t.batch_size * t.seq_len * t.grad_accum} tokens/step. val_loss: one whole training run per "
          "precision, run back to back (runs cannot be interleaved). step_ms: median train_step, all "
          f"precisions interleaved, {args.time_repeats} rounds; run_step_ms: median during each training "
          "run (not interleaved: includes load changes between runs). Low precision is emulated in fp32: "
          "step_ms is the emulation's cost, not a kernel's speed.")
    print(format_table(rows, COLUMNS))
    print(f"optimizer state after one step: adamw {state['adamw']:,} B, adamw_bf16 {state['adamw_bf16']:,} B "
          f"({state['adamw_bf16'] / state['adamw']:.3f}x, saves {state['adamw'] - state['adamw_bf16']:,} B)")
    for row in rows:
        print(json.dumps(row))
    if args.json:
        record = {"command": "dropless bench precision " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "date": time.strftime("%Y-%m-%d %H:%M"), "preset": preset.stem, "steps": t.steps,
                  "threads": torch.get_num_threads(), "time_repeats": args.time_repeats, "rows": rows, "optimizer_state_bytes": state}
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
