"""`dropless bench balance`: the handbook comparison of load-balancing methods on the tiny model.

    dropless bench balance [--steps N] [--json FILE] [--out DIR] [--methods a,b,...] [--set a.b=v ...]

Trains the `tiny` preset once per method, same seed, data and steps, back to back in one command
(whole trainings cannot be interleaved like kernel timings; run them on a quiet machine):
    none          no balancing at all (aux and z losses off)
    aux_micro     Switch aux loss per micro-batch (coefficient 0.01)
    aux_global    Switch aux loss over the global batch (0.01)
    bias          loss-free expert bias, sign rule, u = 1e-3
    quantile      quantile balancing: the bias set each step from the score distribution
    bias_prop     loss-free bias, proportional rule (step u * relative violation), u = 0.02
    bias_adaptive loss-free bias, adaptive rule: the sign rule with a per-expert step from u = 1e-3
                  that grows 1.2x while the sign repeats and halves when it flips (in [u/10, 50u])
    bias_adaptive_lr  the adaptive rule with the step decaying as the lr does after its warm-up
                  (balance.bias_rate_schedule = "lr")
    bias_warm     loss-free bias, sign rule u = 1e-3 after a 50-step quantile warm start
    bias_warm_prop  the proportional rule (u = 0.02) after a 50-step quantile warm start
    bias_adaptive_warm  the adaptive rule (u = 1e-3) after a 50-step quantile warm start
    bias_aux      loss-free bias (sign, u = 1e-3) plus the global aux loss (0.01): a blend
    bias_adaptive_aux  the adaptive bias (u = 1e-3) plus the global aux loss (0.01): a blend
    quantile_aux  quantile balancing plus the global aux loss (0.01): a blend
    quantile_ema  quantile balancing damped: b <- 0.9 b + 0.1 q each step
    quantile_half quantile balancing damped less: b <- 0.5 b + 0.5 q each step
    quantile_ema_aux  the damped quantile rule plus the global aux loss (0.01)
Each step is 4 micro-batches of 4 sequences (the preset's 16 sequences per step), so micro-batch and
global batch differ. Reports final validation loss, global and local MaxVio (worst layer, averaged over the last 20 logged
steps; log_every is forced to 1 so that is the last 20 steps), the first step at which the global
MaxVio (worst layer, 10-step mean) is at most 0.5, and the median step time. docs/quality.md
"Balancing without a quality cost" has the measurements and the choice of rule.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from ..config import load_config
from ..runs.presets import preset_path
from ..runs.sinks import read_jsonl
from .timing import format_table

METHODS: dict[str, list[str]] = {
    "none": ["model.moe.balance.aux_loss_coeff=0", "model.moe.balance.z_loss_coeff=0"],
    "aux_micro": ["model.moe.balance.aux_loss_coeff=0.01"],
    "aux_global": ["model.moe.balance.aux_loss_coeff=0", "model.moe.balance.global_aux_loss_coeff=0.01"],
    "bias": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
             "model.moe.balance.bias_update_rate=0.001"],
    "quantile": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                 "model.moe.balance.quantile_balance=true"],
    "bias_prop": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                  "model.moe.balance.bias_update_rule=proportional", "model.moe.balance.bias_update_rate=0.02"],
    "bias_adaptive": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                      "model.moe.balance.bias_update_rate=0.001", "model.moe.balance.bias_update_rule=adaptive"],
    "bias_adaptive_lr": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                         "model.moe.balance.bias_update_rate=0.001", "model.moe.balance.bias_update_rule=adaptive",
                         "model.moe.balance.bias_rate_schedule=lr"],
    "bias_warm": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                  "model.moe.balance.bias_update_rate=0.001", "model.moe.balance.bias_warm_start_steps=50"],
    "bias_warm_prop": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                       "model.moe.balance.bias_update_rule=proportional", "model.moe.balance.bias_update_rate=0.02",
                       "model.moe.balance.bias_warm_start_steps=50"],
    "bias_adaptive_warm": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                           "model.moe.balance.bias_update_rate=0.001", "model.moe.balance.bias_update_rule=adaptive",
                           "model.moe.balance.bias_warm_start_steps=50"],
    "bias_aux": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                 "model.moe.balance.bias_update_rate=0.001", "model.moe.balance.global_aux_loss_coeff=0.01"],
    "bias_adaptive_aux": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                          "model.moe.balance.bias_update_rate=0.001", "model.moe.balance.bias_update_rule=adaptive",
                          "model.moe.balance.global_aux_loss_coeff=0.01"],
    "quantile_aux": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                     "model.moe.balance.quantile_balance=true", "model.moe.balance.global_aux_loss_coeff=0.01"],
    "quantile_ema_aux": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                         "model.moe.balance.quantile_balance=true", "model.moe.balance.quantile_momentum=0.9",
                         "model.moe.balance.global_aux_loss_coeff=0.01"],
    "quantile_ema": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                     "model.moe.balance.quantile_balance=true", "model.moe.balance.quantile_momentum=0.9"],
    "quantile_half": ["model.moe.balance.aux_loss_coeff=0", "model.moe.router.use_expert_bias=true",
                      "model.moe.balance.quantile_balance=true", "model.moe.balance.quantile_momentum=0.5"],
}


def scaled_schedule(steps: int) -> list[str]:
    """Warm-up, evaluation and checkpoints scaled to a shortened run. The preset's 16 sequences per
    step are taken as 4 micro-batches of 4, so that a micro-batch (local MaxVio, the micro-batch aux
    loss) differs from the global batch (global MaxVio, the global aux loss), as in real training."""
    return ["train.batch_size=4", "train.grad_accum=4",
            f"train.steps={steps}", f"train.warmup_steps={max(1, steps // 12)}",
            f"train.eval_every={steps}", f"train.ckpt_every={steps}", "log.log_every=1",
            "log.progress=false", "log.plots=false", "log.tensorboard=false"]


def first_balanced_step(routing: list[dict], level: float = 0.5, window: int = 10) -> int | None:
    """The first step at which the worst layer's global MaxVio, averaged over the last `window` logged
    steps, is at most `level` (a window, so that one lucky step does not count); None if never."""
    vio = [max(layer["maxvio_global"] for layer in r["layers"]) for r in routing]
    for i in range(window - 1, len(vio)):
        if sum(vio[i - window + 1:i + 1]) / window <= level:
            return routing[i]["step"]
    return None


def summarize(run_dir: Path, last: int = 20) -> dict:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    routing = read_jsonl(run_dir / "routing.jsonl")[-last:]
    worst = lambda key, r: max(layer[key] for layer in r["layers"])  # noqa: E731
    return {
        "step_vio_0.5": first_balanced_step(read_jsonl(run_dir / "routing.jsonl")),
        "val_loss": val[-1] if val else None,
        "maxvio_global": statistics.mean(worst("maxvio_global", r) for r in routing) if routing else None,
        "maxvio_local": statistics.mean(worst("maxvio_local", r) for r in routing) if routing else None,
        "step_ms": statistics.median(r["step_ms"] for r in train) if train and "step_ms" in train[0] else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless bench balance", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--out", default=None, help="folder for the runs (default runs/bench-balance-<time>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or args.steps < 2:
        print(f"dropless bench balance: error: unknown methods {unknown} (known: {', '.join(METHODS)})"
              if unknown else f"--steps={args.steps}: must be >= 2", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/bench-balance-{time.strftime('%Y%m%d-%H%M%S')}")
    from ..train.loop import Trainer

    rows = []
    for i, method in enumerate(methods):
        cfg = load_config(preset_path("tiny"), scaled_schedule(args.steps) + METHODS[method] + args.overrides)
        print(f"[{i + 1}/{len(methods)}] {method}: {args.steps} steps ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        Trainer(cfg, out / method).fit()
        row = {"method": method, **summarize(out / method), "wall_s": time.perf_counter() - start}
        print(f"    val_loss {row['val_loss']:.4f}  maxvio_global {row['maxvio_global']:.3f}  "
              f"maxvio_local {row['maxvio_local']:.3f}  step {row['step_ms']:.0f} ms", file=sys.stderr)
        rows.append(row)
    print(format_table(rows, ["method", "val_loss", "maxvio_global", "maxvio_local", "step_vio_0.5", "step_ms"]))
    print("(sequential whole trainings on one machine; MaxVio: worst layer, mean of the last 20 steps; "
          "step_vio_0.5: first step whose 10-step mean global MaxVio is <= 0.5)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0
