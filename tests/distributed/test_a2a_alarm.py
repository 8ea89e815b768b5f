"""The all-to-all health alarm : a rank whose all-to-alls slow down mid-run fires `a2a_slow`;
the same run without the slowdown stays quiet (and, with `parallel.check_collectives`, passes every
fingerprint check).

The slowdown is a test-only wrapper around `torch.distributed.all_to_all_single`, installed in the
worker process on rank 1 from a chosen step on (what a degraded link or a straggler looks like to the
others: they wait inside the exchange); production code has no hook for it. Every step is a log step
over `log.log_every` steps; the baseline is the median of the rows after the first (monitor/alarms.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from dist_harness import run_world
from dropless.train.loop import Trainer
from tiny_run import tiny

STEPS, LOG_EVERY, SLOW_FROM, DELAY_S = 20, 2, 14, 0.1
# The margin: the default 1.5 is meant for a dedicated interconnect. This 2-core machine, shared by the
# test workers, swings 2.6x between quiet intervals (all-to-all ms per step, one quiet run: 7.96 to
# 20.95; most of it is waiting for the other rank inside the exchange); the injected slowdown (40 ms per
# call on rank 1) measured 35.6x. A full-suite run on that machine under heavier load (other jobs
# beside the test workers) fired the alarm in the quiet run at 6: so 100 ms per call (about 2.5x the
# slowdown above) and a margin of 12.
RATIO = 12.0
# check_collectives: a healthy run passes every fingerprint check (and the slow one too: slow is not wrong)
ARGS = ("parallel.ep_size=2", f"parallel.a2a_alarm_ratio={RATIO}", "parallel.check_collectives=true",
        f"train.steps={STEPS}", f"log.log_every={LOG_EVERY}",
        f"train.eval_every={STEPS}", f"train.ckpt_every={STEPS}", "train.eval_batches=1")


def _run(rank: int, run_dir: Path, slow: bool) -> None:
    trainer = Trainer(tiny(*ARGS), run_dir)
    real_a2a, real_step = dist.all_to_all_single, trainer.train_step
    state = {"slow": False}

    def a2a(*args, **kwargs):
        if state["slow"]:
            time.sleep(DELAY_S)
        return real_a2a(*args, **kwargs)

    def step(s: int, *args):
        state["slow"] = slow and rank == 1 and s >= SLOW_FROM
        return real_step(s, *args)

    dist.all_to_all_single, trainer.train_step = a2a, step
    try:
        trainer.fit()
    finally:
        dist.all_to_all_single = real_a2a


def _worker(rank: int, world: int, root: Path) -> None:
    _run(rank, root / "quiet", slow=False)
    _run(rank, root / "slow", slow=True)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.slow
def test_a2a_alarm_fires_on_a_slow_rank_only(tmp_path: Path) -> None:
    run_world(_worker, 2, tmp_path, tmp_path)
    for name in ("quiet", "slow"):  # every row of an EP run carries the interval's all-to-all time
        assert all(r["a2a_ms"] > 0 for r in _read(tmp_path / name / "routing.jsonl"))
    quiet = [a for a in _read(tmp_path / "quiet" / "health.jsonl") if a["kind"] == "a2a_slow"]
    slow = [a for a in _read(tmp_path / "slow" / "health.jsonl") if a["kind"] == "a2a_slow"]
    assert quiet == []
    assert len(slow) == 1 and slow[0]["step"] >= SLOW_FROM and slow[0]["layer"] is None, slow
    assert slow[0]["value"] > slow[0]["threshold"] == RATIO
