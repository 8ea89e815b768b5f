"""`dropless bench monitor`: what routing-health monitoring costs at its default interval.

    dropless bench monitor [--repeats N] [--log-every K] [--json FILE] [--set a.b=v ...]

Times, interleaved on one model, a plain training step and a log step (detailed layer statistics,
the probe batch, the one host sync of the routing record, the alarm rules). The overhead per step at
interval K is (t_log - t_plain) / (K * t_plain): the log step's extra work spread over the K steps it
covers. Target: at most 3% at the default interval.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ..config import load_config
from ..runs.presets import preset_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless bench monitor", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--log-every", type=int, default=None, help="interval (default: the preset's)")
    p.add_argument("--json", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value")
    args = p.parse_args(argv)
    cfg = load_config(preset_path("tiny"), ["log.progress=false", "log.tensorboard=false",
                                            "log.plots=false"] + args.overrides)
    interval = args.log_every or cfg.log.log_every
    from ..train.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, Path(tmp))
        plain, logged = [], []
        for rep in range(args.repeats + 1):
            for log_step, bucket in ((False, plain), (True, logged)):
                start = time.perf_counter()
                sums, norm = trainer.train_step(rep, log_step)
                if log_step:
                    trainer.log_row(rep, sums, norm, 0.0)
                else:
                    norm.item()  # the plain step also ends with its result on the host
                if rep:  # the first round is warm-up
                    bucket.append(time.perf_counter() - start)
            print(f"\rround {rep + 1}/{args.repeats + 1}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    t_plain, t_log = statistics.median(plain), statistics.median(logged)
    overhead = (t_log - t_plain) / (interval * t_plain)
    row = {"step_ms": 1e3 * t_plain, "log_step_ms": 1e3 * t_log, "log_every": interval,
           "overhead_per_step": overhead}
    print(f"plain step {row['step_ms']:.1f} ms, log step {row['log_step_ms']:.1f} ms, "
          f"interval {interval}: monitoring costs {100 * overhead:.2f}% of step time")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2) + "\n")
    return 0
