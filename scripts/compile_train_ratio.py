"""`make train`'s step with and without `train.compile`, side by side in one process.

    PYTHONPATH=src python scripts/compile_train_ratio.py [--steps 30] [--skip 5] [--set k=v ...]

Two Trainers on the default preset (same seed, same data), the eager one and the compiled one,
step i of one then step i of the other, so machine noise falls on both alike. The compiled trainer's
first step pays the compile (reported as compile_s: that step's wall time minus the eager median);
the first `--skip` steps of each are left out of the medians. Prints tokens/s from wall time and from
this process's CPU time (on a shared machine the CPU clock leaves out other processes' slices), the
compiled/eager ratios, and both runs' losses at the last step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings

import torch

from dropless.config import load_config
from dropless.train.loop import Trainer
from dropless.train.run import PRESETS


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args()
    base = ["log.progress=false", "log.plots=false", "log.tensorboard=false",
            "train.eval_every=100000", "train.ckpt_every=100000", *args.overrides]
    tmp = tempfile.mkdtemp(prefix="compile-ratio-")
    trainers = {}
    for name, extra in (("eager", []), ("compiled", ["train.compile=true"])):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a compile fallback must not pass as a compiled figure
            trainers[name] = Trainer(load_config(PRESETS / "tiny.toml", base + extra), f"{tmp}/{name}")
    t = trainers["eager"].cfg.train
    tokens = t.batch_size * t.seq_len * t.grad_accum
    wall: dict[str, list[float]] = {n: [] for n in trainers}
    cpu: dict[str, list[float]] = {n: [] for n in trainers}
    loss: dict[str, float] = {}
    for step in range(args.steps):
        for name, tr in trainers.items():
            c0, w0 = time.process_time(), time.perf_counter()
            sums, _ = tr.train_step(step)
            loss[name] = float(sums.loss)  # the host read the trainer makes at each log step
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
        print(f"step {step}: " + ", ".join(f"{n} {wall[n][-1] * 1e3:.0f} ms" for n in trainers),
              file=sys.stderr, flush=True)
    med = {n: statistics.median(v[args.skip:]) for n, v in wall.items()}
    cmed = {n: statistics.median(v[args.skip:]) for n, v in cpu.items()}
    print(f"default preset ({tokens} tokens/step), torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"dtype {trainers['eager'].layout.placement.dtype}, medians of steps {args.skip}..{args.steps - 1}")
    for n in trainers:
        print(f"{n:9s} tokens/s wall {tokens / med[n]:8.0f}  cpu {tokens / cmed[n]:8.0f}  loss@{args.steps - 1} {loss[n]:.4f}")
    print(f"compiled / eager tokens/s: wall {med['eager'] / med['compiled']:.3f}, cpu {cmed['eager'] / cmed['compiled']:.3f}")
    print(f"compile_s (first compiled step minus the eager median): {wall['compiled'][0] - med['eager']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
