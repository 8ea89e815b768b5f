"""`dropless bench pipeline`: each pipeline schedule's bubble against the ideal, its step time against pp 1.

Step time against pp 1 means against no stages on the same processes, on the same global batch.

    dropless bench pipeline [--nproc 4] [--pp N] [--config tiny] [--set a.b=v ...]
                            [--schedules gpipe,1f1b,zero_bubble:1,...] [--microbatches 4,8]
                            [--steps 5] [--warmup 1] [--threads 1] [--json FILE]

Spawns --nproc gloo processes on the CPU. Each builds one `Trainer` per variant (as `dropless train`
builds it, in a temporary run directory) from the same config: every (schedule, micro-batches) pair
at parallel.pp_size = --pp (default: --nproc, one pipeline), and the baseline "pp1": pp_size 1 on the
same world (FSDP over --nproc ranks, or whatever --set parallel.ep_size asks) on the same global batch
(train.batch_size x --nproc / --pp rows per optimizer step; pp1 gives each rank batch_size / --pp).
One timed unit is one optimizer step as the trainer runs it (`Trainer.train_step`, not a log step),
after a barrier; variants take turns (bench/timing.py), --warmup untimed steps each first.

Per variant (rank figures are medians over the timed steps):
    ideal          the bubble of a balanced pipeline with free communication: (p - 1) / (m + p - 1) for p
                   pipeline ranks and m micro-batches (gpipe, 1f1b); (p - 1) / (v m + p - 1) with v stages
                   per rank (interleaved_1f1b, zero_bubble, zbv), the 1F1B family's figure, which the
                   zero-bubble schedules set out to beat by filling it with weight-gradient passes
    bubble         1 - compute / wall inside the schedule's calls, per rank (bench/pipeline_clock.py):
                   the mean and the max over ranks. It counts stage imbalance and communication too.
    step_ms        the whole optimizer step, the slowest rank's median; `ratio` = step_ms / pp1's
    sched_ms       the part of it inside the schedule (the rest: gradient norm, optimizer, balancing)
    cpu_frac       the ranks' CPU time over wall time inside compute, mean over ranks: below 1 the
                   ranks competed for cores (more processes than cores), and both bubble and step time
                   are those of the oversubscribed machine, not of one core per stage

Default schedules: gpipe, 1f1b, interleaved_1f1b (2 stages per rank), zero_bubble (2 per rank, or 1
when the model has fewer than 2 x --pp blocks) and zbv (2 per rank); the ones whose stages outnumber
model.n_layers are left out, with a note. `--schedules NAME:V` picks the stages per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import atomic
from ..config import RunConfig, load_config
from ..cpu_alloc import keep_freed_memory
from ..distributed.worker_exit import end_worker
from ..pipeline_config import SCHEDULES
from ..runs.presets import preset_path
from ..train.loop import Trainer
from .pipeline_clock import StageClock
from .timing import cpu_flags, format_table, interleaved

FIXED = ["train.device=cpu", "log.progress=false", "log.tensorboard=false", "log.plots=false"]
COLUMNS = ["variant", "p", "v", "m", "ideal_formula", "ideal", "bubble_mean", "bubble_max", "step_ms",
           "ratio", "sched_ms", "cpu_frac"]


@dataclass(frozen=True)
class Variant:
    schedule: str  # one of SCHEDULES, or "pp1" (no stages)
    pp: int
    stages_per_rank: int = 1
    microbatches: int = 0

    @property
    def name(self) -> str:
        if self.schedule == "pp1":
            return "pp1"
        return f"{self.schedule}:v{self.stages_per_rank}:m{self.microbatches}"

    def ideal(self) -> tuple[str, float]:
        """(formula, bubble) of a balanced pipeline with free communication (module note)."""
        p, v, m = self.pp, self.stages_per_rank, self.microbatches
        if self.schedule == "pp1":
            return "-", 0.0
        return ("(p-1)/(m+p-1)" if v == 1 else "(p-1)/(vm+p-1)"), (p - 1) / (v * m + p - 1)

    def overrides(self, batch_size: int) -> list[str]:
        if self.schedule == "pp1":
            return ["parallel.pp_size=1", f"train.batch_size={batch_size // self.pp}"]
        return [f"parallel.pp_size={self.pp}", f"parallel.pp_schedule={self.schedule}",
                f"parallel.pp_microbatches={self.microbatches}", f"parallel.pp_stages_per_rank={self.stages_per_rank}"]


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r}: a comma-separated list of positive integers") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag}={text!r}: a comma-separated list of positive integers")
    return values


def _schedules(text: str | None, pp: int, n_layers: int) -> tuple[list[tuple[str, int]], list[str]]:
    """(schedule, stages per rank) pairs, and notes on the defaults left out (module note)."""
    if text is None:
        two = 2 * pp <= n_layers
        pairs = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2 if two else 1), ("zbv", 2)]
        kept = [(s, v) for s, v in pairs if v * pp <= n_layers]
        notes = [f"{s} left out: {v} stages per rank x pp {pp} > model.n_layers={n_layers}"
                 for s, v in pairs if (s, v) not in kept]
        return kept, notes
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, _, v = item.partition(":")
        if name not in SCHEDULES:
            raise ValueError(f"--schedules={text!r}: {name!r} is not one of {', '.join(SCHEDULES)}")
        if v and not (v.isdigit() and int(v) >= 1):
            raise ValueError(f"--schedules={text!r}: {item!r}: the stages per rank after ':' are a positive integer")
        pair = (name, int(v) if v else (2 if name in ("interleaved_1f1b", "zbv") else 1))
        if pair in out:
            raise ValueError(f"--schedules={text!r}: {name} with {pair[1]} stages per rank is named twice")
        out.append(pair)
    if not out:
        raise ValueError(f"--schedules={text!r}: name at least one schedule")
    return out, []


def plan(args: argparse.Namespace) -> tuple[list[Variant], list[RunConfig], list[str]]:
    """The variants, their checked configs (pp1 last) and notes; every `ValueError` names the flag or
    the config field and its value, before any process starts."""
    for flag, v, least in (("--nproc", args.nproc, 2), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                           ("--threads", args.threads, 1)):
        if v < least:
            why = " (a pipeline needs 2 ranks)" if flag == "--nproc" else ""
            raise ValueError(f"{flag}={v}: must be >= {least}{why}")
    pp = args.pp or args.nproc
    if pp < 2 or args.nproc % pp:
        raise ValueError(f"--pp={pp}: must be >= 2 and divide --nproc={args.nproc}")
    path = preset_path(args.config)
    extra = [*FIXED, f"train.threads={args.threads}"]
    base = load_config(path, [*args.overrides, *extra])
    ep, batch = base.parallel.ep_size, base.train.batch_size
    if args.nproc % (pp * ep):
        raise ValueError(f"parallel.ep_size={ep} x --pp={pp} does not divide --nproc={args.nproc}")
    if batch % pp:
        raise ValueError(f"train.batch_size={batch}: the pp1 baseline splits it over --pp={pp} times as many "
                         "data-parallel ranks; make it a multiple of --pp")
    pairs, notes = _schedules(args.schedules, pp, base.model.n_layers)
    micro = _ints(args.microbatches, "--microbatches")
    variants = [Variant(s, pp, v, m) for s, v in pairs for m in micro] + [Variant("pp1", pp)]
    configs = []
    for var in variants:
        try:
            configs.append(load_config(path, [*args.overrides, *extra, *var.overrides(batch)]))
        except ValueError as err:
            flags = "" if var.schedule == "pp1" else \
                f"--schedules {var.schedule}:{var.stages_per_rank} --microbatches {var.microbatches}: "
            raise ValueError(f"{flags}{err}") from None
    return variants, configs, notes


def _worker(rank: int, args: argparse.Namespace, variants: list[Variant], configs: list[RunConfig],
            tmp: str) -> None:
    keep_freed_memory()  # spawned: the parent's mallopt does not carry over
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=args.nproc)
    try:
        trainers = {v.name: Trainer(cfg, Path(tmp) / v.name.replace(":", "_")) for v, cfg in zip(variants, configs)}
        clocks = {name: StageClock(t.layout.pipeline) for name, t in trainers.items() if t.layout.pipeline is not None}
        steps = dict.fromkeys(trainers, 0)

        def one_step(name: str) -> None:
            clock = clocks.get(name)
            if clock is not None:
                clock.start()
            trainers[name].train_step(steps[name])
            steps[name] += 1
            if clock is not None:
                clock.stop()

        say = (lambda r: print(f"bench pipeline: round {r + 1}/{args.steps}", file=sys.stderr, flush=True)) \
            if rank == 0 else None
        if say is not None:
            print(f"bench pipeline: {len(trainers)} variants built; {args.warmup} warm-up round(s)", file=sys.stderr,
                  flush=True)
        ms = interleaved({name: (lambda n=name: one_step(n)) for name in trainers}, args.steps, args.warmup,
                         progress=say, before=dist.barrier)
        mine = {name: {"step_ms": ms[name], **(clocks[name].summary(args.warmup) if name in clocks else {})}
                for name in trainers}
        ranks: list = [None] * args.nproc
        dist.all_gather_object(ranks, mine)
        if rank == 0:
            with atomic.atomic_write(Path(tmp) / "ranks.json", "w") as fh:
                json.dump(ranks, fh)
    except BaseException:
        dist.destroy_process_group()
        raise
    end_worker()


def rows(variants: list[Variant], ranks: list[dict[str, dict[str, float]]]) -> list[dict]:
    """One row per variant from every rank's figures (module note); pp1 is the ratio's base."""
    out = []
    for var in variants:
        per = [r[var.name] for r in ranks]
        formula, ideal = var.ideal()
        stages = var.schedule != "pp1"
        row = {"variant": var.schedule, "p": var.pp if stages else 1, "v": var.stages_per_rank if stages else None,
               "m": var.microbatches if stages else None, "ideal_formula": formula, "ideal": ideal,
               "step_ms": max(x["step_ms"] for x in per)}
        if "bubble" in per[0]:
            bubbles = [x["bubble"] for x in per]
            row.update(bubble_mean=sum(bubbles) / len(bubbles), bubble_max=max(bubbles),
                       bubble_ranks=bubbles, sched_ms=max(x["sched_ms"] for x in per),
                       cpu_frac=sum(x["compute_cpu_frac"] for x in per) / len(per))
        out.append(row)
    base = next(r["step_ms"] for r, v in zip(out, variants) if v.schedule == "pp1")
    for r in out:
        r["ratio"] = r["step_ms"] / base
    return out


def run(args: argparse.Namespace) -> dict:
    """Checks, spawns, measures; {"rows", "meta", "notes"}."""
    variants, configs, notes = plan(args)
    with tempfile.TemporaryDirectory(prefix="dropless-bench-pipeline-") as tmp:
        mp.start_processes(_worker, args=(args, variants, configs, tmp), nprocs=args.nproc, start_method="spawn")
        ranks = json.loads((Path(tmp) / "ranks.json").read_text())
    base = configs[-1]
    meta = {"nproc": args.nproc, "pp": variants[0].pp, "config": args.config, "overrides": args.overrides,
            "batch_size": configs[0].train.batch_size, "seq_len": base.train.seq_len,
            "grad_accum": base.train.grad_accum, "steps": args.steps, "warmup": args.warmup,
            "threads": args.threads, "cores": os.cpu_count(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
            "variants": [asdict(v) for v in variants]}
    return {"rows": rows(variants, ranks), "meta": meta, "notes": notes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless bench pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="gloo processes (default 4)")
    p.add_argument("--pp", type=int, default=0, help="pipeline ranks (default: --nproc)")
    p.add_argument("--config", default="tiny", help="preset name or TOML file (default: tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=v",
                   help="override a field in every variant (repeatable); the bench sets parallel.pp_*")
    p.add_argument("--schedules", help="comma-separated NAME or NAME:V (V stages per rank); default: gpipe, 1f1b, "
                   "interleaved_1f1b:2, zero_bubble:2 (:1 with fewer than 2 x pp blocks), zbv, where the blocks allow")
    p.add_argument("--microbatches", default="4,8", help="comma-separated micro-batches per batch (default 4,8)")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per variant (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--json", help="also write the rows and the machine here")
    args = p.parse_args(argv)
    try:
        out = run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless bench pipeline: error: {err}", file=sys.stderr)
        return 2
    m = out["meta"]
    print(format_table(out["rows"], COLUMNS))
    for note in out["notes"]:
        print(note)
    print(f"{m['nproc']} processes x {m['threads']} thread(s) on {m['cores']} cores; CPU flags: {m['cpu_flags']}; "
          f"torch {m['torch']}; global batch {m['batch_size'] * m['nproc'] // m['pp']} x {m['seq_len']} tokens; "
          f"median of {m['steps']} steps; ratio = step_ms / pp1's")
    if m["nproc"] * m["threads"] > (m["cores"] or 1):
        print("more threads than cores: the ranks share cores, so stages do not run side by side "
              "(cpu_frac < 1); bubble and ratio are those of this oversubscribed machine")
    if args.json:
        with atomic.atomic_write(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0
