"""`dropless bench step`: the trainer's own optimizer step for two configs, timed in turns, with a split.

    dropless bench step [--config tiny] [--compare dense] [--set a.b=v ...] [--repeats 3]
                        [--warmup 1] [--threads N] [--json FILE] [--no-profile]

What is timed is what `dropless train` runs: a `Trainer` per config (built as `dropless train`
builds it, in a temporary run directory), and one timed unit is a log interval of `log.log_every`
optimizer steps, the last a log step (detailed statistics, the host read of the losses, the routing
monitor's probe and record), exactly as `Trainer.fit` runs them, less evaluation and checkpoints.
step_ms = the interval's wall time / log_every, the median over `--repeats` intervals timed in turns
(bench/timing.py: one config's interval, then the other's), after `--warmup` untimed intervals each.
`--set` overrides apply to both configs (e.g. `--set train.dtype=fp32`).

The split: one more interval per config under torch.profiler, with ranges (bench/step_profile.py;
a backward op is charged to the part whose forward made it):
    attention      the attention modules (projections, rotary, SDPA)
    ffn_gemms      the routed experts (GroupedExperts: the grouped GEMMs and their activation) and
                   the dense and shared MLPs: the FFN compute a dense model also does
    routing        the MoE layer outside its experts: router, top-k, dispatch (sort, permute),
                   combine, the layer's losses and statistics
    optimizer      gradient norm and clipping, the optimizer step, zero_grad
    monitor        the trainer's routing health: per micro-batch accumulation, the balancing rules
                   at the end of each step, the log step's probe and record
    other          the rest: embedding, norms, head and loss, autograd bookkeeping, the data
Shares are of the profiled interval; the profiler's own overhead inflates the many small ops a little.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..config import load_config
from ..layers.experts import GroupedExperts
from ..layers.mla import LatentAttention
from ..layers.mlp import MLP
from ..layers.moe import MoELayer
from ..model import Attention
from ..runs.presets import preset_path
from ..train.loop import Trainer
from . import step_profile
from .timing import cpu_flags, format_table, interleaved

PARTS = ("attention", "ffn_gemms", "routing", "optimizer", "monitor")


@dataclass
class Subject:
    """One config's trainer and where its run is (the interval's steps continue from one call to the next)."""

    name: str
    trainer: Trainer
    step: int = 0

    def interval(self) -> None:
        """`log.log_every` optimizer steps as `Trainer.fit` runs them, the last a log step."""
        tr = self.trainer
        n = tr.cfg.log.log_every
        for i in range(n):
            step = self.step % tr.cfg.train.steps
            sums, grad_norm = tr.train_step(step, log_step=i == n - 1)
            self.step += 1
        tr.log_row(step, sums, grad_norm, 0.0)


def build(name: str, overrides: list[str], run_dir: Path) -> Subject:
    cfg = load_config(preset_path(name), [*overrides, "log.progress=false"])
    return Subject(name, Trainer(cfg, run_dir))


def _wrap(obj: object, method: str, part: str) -> None:
    """obj.method runs inside a profiler range named `part` (an instance attribute: the bench's own
    trainer only)."""
    fn = getattr(obj, method)

    def ranged(*args, **kwargs):
        with torch.profiler.record_function(part):
            return fn(*args, **kwargs)

    setattr(obj, method, ranged)


def profile(subject: Subject) -> dict[str, float]:
    """Each part's share of one interval (module note)."""
    tr = subject.trainer
    model = tr.model
    mods = {"attention": [m for m in model.modules() if isinstance(m, (Attention, LatentAttention))],
            "routing": [m for m in model.modules() if isinstance(m, MoELayer)],
            "ffn_gemms": [m for m in model.modules() if isinstance(m, (GroupedExperts, MLP))]}
    handles = step_profile.ranges(mods)
    _wrap(tr.layout, "finish_grads", "optimizer")
    _wrap(tr.optimizer, "step", "optimizer")
    _wrap(tr.optimizer, "zero_grad", "optimizer")
    for method in ("add_micro", "end_step", "begin_step", "record"):
        _wrap(tr.health, method, "monitor")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.profiler.record_function("bench.step"):
                subject.interval()
    finally:
        for h in handles:
            h.remove()
        for obj, names in ((tr.layout, ["finish_grads"]), (tr.optimizer, ["step", "zero_grad"]),
                           (tr.health, ["add_micro", "end_step", "begin_step", "record"])):
            for method in names:
                vars(obj).pop(method, None)
    shares = step_profile.split(prof.events(), torch.device("cpu"), PARTS)
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def run(configs: list[str], overrides: list[str], repeats: int, warmup: int, do_profile: bool = True,
        progress: Callable[[str], None] | None = None) -> dict:
    """Rows in the order of `configs`, each with step_ms, its ratio to the last config's (the
    baseline, `--compare`) and the split; plus the machine."""
    say = progress or (lambda _: None)
    with tempfile.TemporaryDirectory(prefix="dropless-bench-step-") as tmp:
        subjects = []
        for i, name in enumerate(configs):
            say(f"build {name}")
            subjects.append(build(name, overrides, Path(tmp) / f"{i}-{Path(name).stem}"))
        say("timing")
        ms = interleaved({s.name: s.interval for s in subjects}, repeats=repeats, warmup=warmup,
                         progress=lambda r: say(f"round {r + 1}/{repeats}"))
        base = ms[subjects[-1].name] / subjects[-1].trainer.cfg.log.log_every
        rows = []
        for s in subjects:
            step_ms = ms[s.name] / s.trainer.cfg.log.log_every
            row = {"config": s.name, "step_ms": step_ms, "ratio": step_ms / base,
                   "tokens_per_step": s.trainer.data.tokens_per_step()}
            if do_profile:
                say(f"profile {s.name}")
                row.update({f"{p}_share": v for p, v in profile(s).items()})
            rows.append(row)
    meta = {"threads": torch.get_num_threads(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
            "dtype": str(subjects[0].trainer.layout.placement.autocast_dtype or torch.float32),
            "log_every": [s.trainer.cfg.log.log_every for s in subjects], "repeats": repeats, "overrides": overrides}
    return {"rows": rows, "meta": meta}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless bench step", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", help="preset name or TOML file (default: tiny)")
    p.add_argument("--compare", default="dense", help="the baseline config (default: dense); '' = none")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=v",
                   help="override a field in both configs (repeatable)")
    p.add_argument("--repeats", type=int, default=3, help="timed log intervals per config")
    p.add_argument("--warmup", type=int, default=1, help="untimed log intervals per config first")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-profile", action="store_true", help="skip the split")
    p.add_argument("--json", help="also write the rows and the machine here")
    args = p.parse_args(argv)
    for field, v in (("--repeats", args.repeats), ("--warmup", args.warmup)):
        if v < (1 if field == "--repeats" else 0):
            p.error(f"{field}={v}: must be >= {1 if field == '--repeats' else 0}")
    if args.threads:
        torch.set_num_threads(args.threads)
        args.overrides = [*args.overrides, f"train.threads={args.threads}"]
    configs = [args.config] + ([args.compare] if args.compare else [])
    bar = tqdm(desc="bench step", total=None, file=sys.stderr, leave=False)
    try:
        out = run(configs, args.overrides, args.repeats, args.warmup, not args.no_profile,
                  progress=lambda s: (bar.set_postfix_str(s), bar.update(1)))
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless bench step: error: {err}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    cols = ["config", "step_ms", "ratio", "tokens_per_step"]
    if not args.no_profile:
        cols += [f"{p}_share" for p in (*PARTS, "other")]
    print(format_table(out["rows"], cols))
    m = out["meta"]
    print(f"threads {m['threads']}; CPU flags: {m['cpu_flags']}; autocast {m['dtype']}; torch {m['torch']}; "
          f"ratio = step_ms / {configs[-1]}'s; median of {m['repeats']} log intervals of {m['log_every']} steps")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0
