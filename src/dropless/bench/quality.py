"""`dropless bench quality`: what each design knob does to quality, one short training per variant.

    dropless bench quality [--steps N] [--variants a,b,...] [--seeds S1,S2,...] [--config PRESET]
                           [--set a.b=v ...] [--json FILE] [--out DIR]
    dropless bench quality --table A.json [B.json ...]     # one table from saved rows (no training)

Trains each variant of the preset (default `tiny`) for the same steps, tokens and seed, back to back,
and tabulates the final validation loss (nats/byte), active and total parameters, tokens/s, the final
global MaxVio (worst layer, mean of the last 5 logged steps) and the val loss relative to the `dense`
row. A logged step's global MaxVio is the worst of its log interval's steps, each over one step's
batch, so it carries the batch-to-batch noise (which documents the batch holds); `maxvio_span` is the
MaxVio of the counts summed over those same last 5 intervals (worst layer): the imbalance that
persists across batches, the part that a bias rule, which only sees past steps, can remove.
`maxvio_mean` averages instead of taking the interval's worst step: the worst layer's global MaxVio
of each step, averaged over the last 5 intervals' steps (`bench balance`'s maxvio_global, over 50
steps instead of 20). `first_vio_0.5` is the last step of the first log interval in which every
step's global MaxVio, in every layer, was at most 0.5; `first_mean_0.5` that of the first interval
whose `maxvio_mean` measure was at most 0.5 (`bench balance`'s step_vio_0.5 read at interval ends,
the measure the balancing targets are stated in); "never" if none was.
Variants are overrides of the preset, derived from its own shape (E experts, top-k, width f, model
width d), so that they stay meaningful when the preset changes. Every row but `default` starts
from the preset's plain MoE: the quality knobs of KNOBS_OFF at their off values, so a knob the preset
turns on (identity experts, say) is still measured as one change against the same `moe` row:
    default        the preset as it is
    dense          every layer a dense MLP of width k*f (+ shared width): the same active parameters
    moe            the preset's plain MoE (KNOBS_OFF)
    moe_adamw      the preset with AdamW at ADAMW_LR
    moe_muon       the preset with expert-wise Muon at MUON_LR
    latent         LatentMoE, l = d/2
    identity       E/4 identity (zero-compute) experts beside the E real ones
    parallel       parallel MoE block (the MoE reads the block's input)
    mtp1           multi-token prediction, depth 1
    top1           top-1 routing (the preset's experts)
    top2           top-2 routing
    fine           fine-grained: 2E experts of width f/2, top-2k (same active and total parameters)
    bal_<method>   the preset with a balancing method of `dropless bench balance` (aux_global, bias,
                   quantile, none, aux_micro): the balancing rows
Overrides given with --set apply to every variant first; a variant's own overrides win over them.
--seeds trains every variant once per seed (train.seed: the initial weights and the batch order) and
tabulates each variant's mean, its range, and vs_dense as the mean (and range) of the per-seed ratios
to the dense run of the same seed: one 600-step run of the tiny preset moves by ~3% with the seed
alone (docs/quality.md), so one seed cannot rank variants closer than that.
Whole trainings cannot be interleaved like kernel timings: tokens/s of different rows are only
comparable on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from .. import atomic
from ..config import RunConfig, load_config
from ..runs.presets import preset_path
from ..runs.sinks import read_jsonl
from .balance import METHODS as BALANCE_METHODS
from .timing import format_table

# each optimizer's train.lr for its row when it is not the preset's own: the best of each optimizer's
# 600-step grid on the tiny preset (docs/quality.md "Optimizer and learning rate")
MUON_LR, ADAMW_LR = "5e-3", "1e-3"
# the model knobs (docs/model_knobs.md) at their off values (config.py's defaults): the base of every row but
# `default`. The preset's shape, router, balancing and optimizer are kept.
KNOBS_OFF = ["model.mtp_depth=0", "model.moe.n_identity_experts=0", "model.moe.latent_dim=0",
             "model.moe.latent_norm=false", "model.block=sequential"]
COLUMNS = ["variant", "val_loss", "vs_dense", "active_M", "total_M", "tokens_per_s", "maxvio_global",
           "maxvio_mean", "maxvio_span", "first_vio_0.5", "first_mean_0.5", "wall_s"]
# with more than one seed per variant: means, the val range, and the range of the paired ratios
SEED_COLUMNS = ["variant", "seeds", "val_loss", "val_range", "vs_dense", "vs_dense_range", "active_M",
                "total_M", "tokens_per_s", "maxvio_global", "maxvio_mean", "maxvio_span", "first_vio_0.5",
                "first_mean_0.5", "wall_s"]


def variants(cfg: RunConfig) -> dict[str, list[str]]:
    """Each variant's overrides, derived from the loaded preset `cfg` (E, k, f, d)."""
    m, moe = cfg.model, cfg.model.moe
    E, k, f, d = moe.num_experts, moe.top_k, moe.d_expert, m.d_model
    shared = moe.n_shared_experts * (moe.d_shared or f)
    out = {
        "default": [],
        "dense": [f"model.n_dense_layers={m.n_layers}", f"model.d_ff_dense={k * f + shared}",
                  "model.moe_layer_freq=1"],
        "moe": [],
        "moe_adamw": ["train.optimizer=adamw", f"train.lr={ADAMW_LR}"],
        "moe_muon": ["train.optimizer=muon", f"train.lr={MUON_LR}"],
        "latent": [f"model.moe.latent_dim={d // 2}"],
        "identity": [f"model.moe.n_identity_experts={max(1, E // 4)}"],
        "parallel": ["model.block=parallel_moe"],
        "mtp1": ["model.mtp_depth=1"],
        "top1": ["model.moe.top_k=1"],
        "top2": ["model.moe.top_k=2"],
        "fine": [f"model.moe.num_experts={2 * E}", f"model.moe.d_expert={max(1, f // 2)}",
                 f"model.moe.top_k={2 * k}"],
    }
    # the balancing rows: bench balance's methods, each on top of the preset's own balancing
    # settings cleared to the same baseline that bench uses (its aux coefficient set explicitly)
    out.update({f"bal_{name}": list(sets) for name, sets in BALANCE_METHODS.items()})
    return {name: sets if name == "default" else KNOBS_OFF + sets for name, sets in out.items()}


def schedule(cfg: RunConfig, steps: int) -> list[str]:
    """The preset's schedule shortened to `steps`: warm-up scaled in proportion, one evaluation and
    one checkpoint at the end, a routing row every 10 steps (or fewer)."""
    t = cfg.train
    warmup = max(1, round(t.warmup_steps * steps / t.steps)) if t.steps else 1
    return [f"train.steps={steps}", f"train.warmup_steps={min(warmup, steps)}", f"train.eval_every={steps}",
            f"train.ckpt_every={steps}", f"log.log_every={min(cfg.log.log_every, max(1, steps // 5))}",
            "log.plots=false", "log.tensorboard=false"]


def summarize(run_dir: Path, summary: dict, last: int = 5) -> dict:
    every = read_jsonl(run_dir / "routing.jsonl") if (run_dir / "routing.jsonl").exists() else []
    routing = every[-last:]
    # two readings of "reaches MaxVio 0.5": every step of a log interval (the interval max) in every
    # layer, or the worst layer's per-step value averaged over the interval (bench balance's measure,
    # the one the balancing targets are stated in); rows from before the monitor kept the mean have none
    reached = next((r["step"] for r in every if max(layer["maxvio_global"] for layer in r["layers"]) <= 0.5), None)
    has_mean = bool(every) and all(r.get("maxvio_worst_mean") is not None for r in every)
    reached_mean = next((r["step"] for r in every if r["maxvio_worst_mean"] <= 0.5), None) if has_mean else None
    maxvio = (statistics.mean(max(layer["maxvio_global"] for layer in r["layers"]) for r in routing)
              if routing else None)
    maxvio_mean = statistics.mean(r["maxvio_worst_mean"] for r in routing) if has_mean else None
    # the counts of the last intervals summed per layer, then the worst layer's MaxVio
    span = None
    if routing:
        summed = [[sum(c) for c in zip(*(r["layers"][i]["counts"] for r in routing))]
                  for i in range(len(routing[0]["layers"]))]
        span = max(max(c) / (sum(c) / len(c)) - 1 if sum(c) else 0.0 for c in summed)
    return {"val_loss": summary["final_val_loss"], "active_M": summary["params_active"] / 1e6,
            "total_M": summary["params_total"] / 1e6, "tokens_per_s": summary["tokens_per_s"],
            "maxvio_global": maxvio, "maxvio_mean": maxvio_mean, "maxvio_span": span, "first_vio_0.5": reached,
            **({"first_mean_0.5": reached_mean} if has_mean else {})}


def table(rows: list[dict]) -> str:
    """One line per variant. A variant run at several seeds shows its mean val loss and range; vs_dense
    pairs each run with the dense run of the same seed (the same batches), then averages the ratios.
    Rows without a seed (saved before --seeds existed) pair with a dense row without one."""
    dense = {r.get("seed"): r["val_loss"] for r in rows if r["variant"] == "dense"}
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["variant"], []).append(r)
    multi = any(len(g) > 1 for g in groups.values())
    shown = []
    for name, g in groups.items():
        vals = [r["val_loss"] for r in g]
        rel = [100 * (r["val_loss"] / dense[r.get("seed")] - 1) for r in g if r.get("seed") in dense]
        maxvio = [r["maxvio_global"] for r in g if r.get("maxvio_global") is not None]
        span = [r["maxvio_span"] for r in g if r.get("maxvio_span") is not None]
        vmean = [r["maxvio_mean"] for r in g if r.get("maxvio_mean") is not None]
        s = {"variant": name, "seeds": str(len(g)), "val_loss": f"{statistics.mean(vals):.4f}",
             "val_range": f"{min(vals):.4f}..{max(vals):.4f}",
             "vs_dense": f"{statistics.mean(rel):+.2f}%" if rel else None,
             "vs_dense_range": f"{min(rel):+.2f}..{max(rel):+.2f}%" if rel else None,
             "active_M": f"{statistics.mean(r['active_M'] for r in g):.2f}",
             "total_M": f"{statistics.mean(r['total_M'] for r in g):.2f}",
             "tokens_per_s": f"{statistics.mean(r['tokens_per_s'] for r in g):,.0f}",
             "maxvio_global": f"{statistics.mean(maxvio):.2f}" if maxvio else None,
             "maxvio_mean": f"{statistics.mean(vmean):.2f}" if vmean else None,
             "maxvio_span": f"{statistics.mean(span):.2f}" if span else None,
             # per seed, in run order (a first step does not average); rows saved before the column
             # existed show nothing rather than "never"
             "first_vio_0.5": "/".join("never" if r["first_vio_0.5"] is None else str(r["first_vio_0.5"])
                                       for r in g) if maxvio and all("first_vio_0.5" in r for r in g) else None,
             "first_mean_0.5": "/".join("never" if r["first_mean_0.5"] is None else str(r["first_mean_0.5"])
                                        for r in g) if all("first_mean_0.5" in r for r in g) else None,
             "wall_s": f"{sum(r['wall_s'] for r in g):.0f}"}
        shown.append(s)
    return format_table(shown, SEED_COLUMNS if multi else COLUMNS)


def parse_seeds(text: str) -> list[int]:
    """--seeds: distinct non-negative integers, comma-separated."""
    try:
        seeds = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--seeds={text!r}: must be comma-separated integers") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds={text!r}: must name distinct integers >= 0")
    return seeds


def parse_variants(text: str, known: dict[str, list[str]]) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in known]
    if unknown or not names:
        raise ValueError(f"--variants={text!r}: unknown variant {unknown[0]!r} (known: {', '.join(known)})"
                         if unknown else f"--variants={text!r}: no variant named")
    return names


def write_json(path: Path, rows: list[dict]) -> None:
    """Atomically (atomic.py): a crashed bench leaves no half-written json."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, json.dumps(rows, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless bench quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--config", default="tiny", help="the preset whose variants to train (default tiny)")
    p.add_argument("--variants", default="dense,moe,moe_adamw,latent,identity,parallel,mtp1,top1,fine,"
                                         "bal_bias,bal_bias_adaptive,bal_quantile")
    p.add_argument("--seeds", default=None, metavar="S1,S2,...",
                   help="train every variant once per seed and tabulate means (default: the preset's seed)")
    p.add_argument("--json", default=None, help="write the rows here (one per variant and seed)")
    p.add_argument("--out", default=None, help="folder for the runs (default runs/bench-quality-<time>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value")
    p.add_argument("--table", nargs="+", default=None, metavar="JSON",
                   help="print one table from these saved --json files and exit (no training)")
    args = p.parse_args(argv)
    prog = "dropless bench quality"
    try:
        if args.table:
            print(table([r for f in args.table for r in json.loads(Path(f).read_text())]))
            return 0
        if args.steps < 2:
            raise ValueError(f"--steps={args.steps}: must be >= 2")
        preset = preset_path(args.config)
        base = load_config(preset, list(args.overrides))
        known = variants(base)
        names = parse_variants(args.variants, known)
        common = schedule(base, args.steps) + list(args.overrides)
        seeds = parse_seeds(args.seeds) if args.seeds is not None else [base.train.seed]
        # seed-major: a bench that dies keeps whole seeds, every variant paired with its dense run
        runs = [(v, s, f"{v}-s{s}" if args.seeds is not None else v) for s in seeds for v in names]
        cfgs = {d: load_config(preset, common + known[v] + [f"train.seed={s}"])  # every config checked first
                for v, s, d in runs}
    except (ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/bench-quality-{time.strftime('%Y%m%d-%H%M%S')}")
    from ..train.loop import Trainer

    rows = []
    for i, (name, seed, folder) in enumerate(runs):
        print(f"[{i + 1}/{len(runs)}] {name}, seed {seed}: {args.steps} steps ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        summary = Trainer(cfgs[folder], out / folder).fit()
        row = {"variant": name, "seed": seed, **summarize(out / folder, summary),
               "wall_s": time.perf_counter() - start, "steps": args.steps, "overrides": known[name]}
        print(f"    val_loss {row['val_loss']:.4f}  {row['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)
        rows.append(row)
        if args.json:  # after every row: a long bench that dies keeps what it measured
            write_json(Path(args.json), rows)
    print(table(rows))
    print(f"(--steps {args.steps}, preset {args.config}, seeds {','.join(map(str, seeds))}; sequential whole "
          "trainings on one machine; MaxVio: worst layer, mean of the last 5 logged steps, each its "
          "interval's worst step; maxvio_mean: of every step; span: of their summed counts)")
    return 0
