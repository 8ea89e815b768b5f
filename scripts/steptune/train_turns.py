"""Training-step throughput of several source trees or settings, timed in turns inside one script.

    python scripts/steptune/train_turns.py ROUNDS STEPS_PER_TURN PRESET 'name|SRC_DIR|a.b=v ...' ...

Each variant is a worker process (this file with --worker) that builds one Trainer from PRESET with
its overrides, importing dropless from SRC_DIR, and runs STEPS_PER_TURN optimizer steps when told
(the loop's per-step work: train_step, and on every 10th step the log row). The parent alternates the
order every round, so slow drift of a shared machine's load hits every variant alike; tokens/s =
batch_size * seq_len * steps / seconds of each turn, and each round's ratio to the first variant.
With TURNS_INIT=<checkpoint folder> every worker starts from those weights (a trained model routes
far more evenly than the init). docs/training_speed.md, "Where a CPU training step goes".
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(preset: str, sets: list[str]) -> None:
    import torch

    from dropless.config import load_config
    from dropless.train.loop import Trainer

    cfg = load_config(preset, ["log.progress=false", "log.plots=false", *sets])
    tr = Trainer(cfg, tempfile.mkdtemp())
    if os.environ.get("TURNS_INIT"):  # a trained checkpoint: the routing of a trained model, not the init's
        from dropless.runs.dist_checkpoint import load_full_model
        load_full_model(os.environ["TURNS_INIT"], tr.model)
    print("ready", tr.layout.placement.describe(), "threads", torch.get_num_threads(),
          "tokens/step", cfg.train.batch_size * cfg.train.seq_len * cfg.train.grad_accum, flush=True)
    step = 0
    for line in sys.stdin:
        n = int(line.split()[1])
        t0 = time.perf_counter()
        for _ in range(n):
            log = (step + 1) % 10 == 0
            stats, grad_norm = tr.train_step(step, log)
            if log:
                tr.log_row(step, stats, grad_norm, 0.0)
                tr.nonfinite.read()
            step += 1
        print(time.perf_counter() - t0, flush=True)


def main(argv: list[str]) -> None:
    rounds, per, preset = int(argv[0]), int(argv[1]), argv[2]
    variants = []
    for spec in argv[3:]:
        name, src, *sets = spec.split("|")
        sets = [s for s in " ".join(sets).split() if s]
        p = subprocess.Popen([sys.executable, __file__, "--worker", preset, *sets], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=src))
        variants.append((name, p))
    tokens = {}
    for name, p in variants:
        line = p.stdout.readline().strip()
        tokens[name] = int(line.split()[-1])
        print(name, line, flush=True)

    def turn(p: subprocess.Popen, n: int) -> float:
        p.stdin.write(f"run {n}\n")
        p.stdin.flush()
        return float(p.stdout.readline())

    for _, p in variants:
        turn(p, 3)  # warm-up: allocator, kernel caches
    res: dict[str, list[float]] = {name: [] for name, _ in variants}
    first = variants[0][0]
    for r in range(rounds):
        for name, p in (variants if r % 2 == 0 else variants[::-1]):
            res[name].append(tokens[name] * per / turn(p, per))
        print(f"round {r} load {os.getloadavg()[0]:.1f} "
              + "  ".join(f"{n} {res[n][-1]:,.0f}" for n, _ in variants)
              + "  ratios to " + first + ": " + " ".join(f"{res[n][-1] / res[first][-1]:.3f}" for n, _ in variants[1:]),
              flush=True)
    for name, _ in variants:
        ratios = [a / b for a, b in zip(res[name], res[first])]
        print(f"{name}: median {statistics.median(res[name]):,.0f} tokens/s; per-round ratio to {first}: "
              f"median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    for _, p in variants:
        p.stdin.close()
        p.wait()


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1:])
