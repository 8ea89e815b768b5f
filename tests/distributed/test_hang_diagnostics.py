"""Hang diagnostics: with `parallel.check_collectives` and a short `collective_timeout_s`, a
rank that skips a collective, or issues it with other sizes, ends the run on every rank within the
timeout with `CollectiveMismatchError` naming the first collective where the ranks differ, instead of
a hang.

The fault is a test-only wrapper installed in the worker around rank 1's health reduction (the
data-parallel all-reduce of the step's expert counts, the first watched reduction of a step);
production code has no hook for it. The cases:
- skip, not at a check step: rank 0 waits in the all-reduce, rank 1 runs on into the next step's FSDP
  all-gather on the same group (a collective the watch does not see); both time out and explain;
- skip at a check step: rank 1 waits at the fingerprint check, rank 0 times out and aborts the check;
- other sizes with the same bytes (a [1, 4] tensor reduced as [4]): gloo completes it (a byte-count
  mismatch is gloo's own abort of the process, "Received data size doesn't match expected size"),
  nothing hangs, and the fingerprints differ at the step's check.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from dist_harness import run_world
from dropless.distributed.fingerprint import CollectiveLog, Entry, divergence
from dropless.distributed.watch import CollectiveMismatchError, CommWatch
from dropless.train.loop import Trainer
from tiny_run import tiny

TIMEOUT_S, FAULT_STEP = 2.0, 2
ARGS = ("parallel.ep_size=2", "parallel.check_collectives=true", f"parallel.collective_timeout_s={TIMEOUT_S}",
        "train.steps=4", "train.eval_every=4", "train.ckpt_every=4", "train.eval_batches=1")


def _faulty_run(rank: int, world: int, root: Path, fault: str, log_every: int) -> None:
    trainer = Trainer(tiny(*ARGS, f"log.log_every={log_every}"), root / "run")
    real_reduce, real_step = trainer.health.reduce, trainer.train_step
    state = {"step": -1, "calls": 0}

    def reduce(t: torch.Tensor, op: str) -> None:
        state["calls"] += 1
        if rank == 1 and state["step"] == FAULT_STEP and state["calls"] == 1:  # the step's first reduction
            (root / "fault_time.txt").write_text(repr(time.time()))
            if fault == "skip":
                return
            t = t.reshape(-1)  # other sizes, the same bytes: gloo completes it (module note)
        real_reduce(t, op)

    def step(s: int, *args):
        state["step"], state["calls"] = s, 0
        return real_step(s, *args)

    trainer.health.reduce, trainer.train_step = reduce, step
    try:
        trainer.fit()
        message = "no error"
    except CollectiveMismatchError as err:
        message = str(err)
    (root / f"rank{rank}.txt").write_text(f"{time.time()!r}\n{message}")
    # stay alive until the peer has explained too: a rank that exits closes its gloo connections, and
    # a peer still inside a collective the watch does not see (the skip case's FSDP all-gather) would
    # then end with gloo's "connection closed" before its own timeout fires (seen on a loaded machine)
    deadline = time.time() + 60
    while not (root / f"rank{1 - rank}.txt").exists() and time.time() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("fault,log_every", [("skip", 2), pytest.param("skip", 1, marks=pytest.mark.slow),
                                              ("sizes", 1)])
def test_divergent_collective_ends_with_an_error_naming_it(tmp_path: Path, fault: str, log_every: int) -> None:
    run_world(_faulty_run, 2, tmp_path, tmp_path, fault, log_every)
    firsts = set()
    for rank in range(2):
        when, message = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        # from the fault: one timeout, up to two where a rank waits for a peer stuck in a collective
        seconds = float(when) - float((tmp_path / "fault_time.txt").read_text())
        assert 0 < seconds < 2 * TIMEOUT_S + 2, (rank, seconds)
        assert "collectives diverged: first divergence at collective #" in message, (rank, message)
        first = message.split("first divergence at collective ")[1].split(":")[0]
        firsts.add(first)
        assert f"rank 0 issued {first} all_reduce(group=dp ranks=[0, 1], float32[1, 4]) in step {FAULT_STEP}" \
            in message, message
        if fault == "skip":
            assert "ranks [1] never issued it" in message, message
        else:
            assert f"rank 1 issued {first} all_reduce(group=dp ranks=[0, 1], float32[4])" in message, message
    assert len(firsts) == 1  # every rank names the same collective


def _report(entries: list[tuple], count_extra: int = 0, flight: bool = False, rank: int = 0) -> dict:
    log = CollectiveLog(keep=4)
    for op, shape, splits in entries:
        log.record(op, "ep", (0, 1), "float32", shape, 0, *(splits or (None, None)))
    last = log.recent[-1] if flight else None
    return log.report(rank, 0, "the check of step 0", last)


def test_divergence_names_the_first_difference() -> None:
    """The comparison itself, on made-up reports: equal logs are quiet; a missing rank, an extra
    collective, other sizes and a variable all-to-all whose splits disagree are each named; a
    difference older than the kept window is still reported by its digest."""
    # a variable all-to-all: rank 0 sends (3, 4) rows to ranks (0, 1), rank 1 sends (5, 4); each
    # entry holds (receive splits, send splits)
    a2a = [("all_to_all", (8, 2), ((3, 5), (3, 4))), ("all_to_all", (8, 2), ((4, 4), (5, 4)))]
    same = [[("all_reduce", (4,), None), a2a[r]] for r in range(2)]
    assert divergence({r: _report(same[r], rank=r) for r in range(2)}, range(2)) is None
    missing = divergence({0: _report(same[0])}, range(2), 2.0)
    assert "ranks [1] did not arrive within 2 s" in missing
    extra = divergence({0: _report(same[0] + [("all_reduce", (4,), None)]), 1: _report(same[1], rank=1)},
                       range(2))
    assert "first divergence at collective #2" in extra and "ranks [1] never issued it" in extra
    sizes = divergence({0: _report(same[0]), 1: _report([("all_reduce", (5,), None), a2a[1]], rank=1)},
                       range(2))
    assert "first divergence at collective #0" in sizes and "float32[5]" in sizes
    # rank 0 sends 6 rows to rank 1, which expects 4: both wait in the exchange
    bad = ("all_to_all", (8, 2), ((3, 5), (3, 6)))
    splits = divergence({0: _report([same[0][0], bad], flight=True), 1: _report(same[1], flight=True, rank=1)},
                        range(2))
    assert "first divergence at collective #1" in splits and "rank 0 sends 6 rows to rank 1, which expects 4" in splits
    # fingerprints off: nothing recorded, each rank still says which collective it waits in
    off = {r: CollectiveLog().report(r, 5, "-", Entry(-1, 5, op, "ep", (0, 1), "float32", (4,)))
           for r, op in enumerate(("all_reduce", "all_to_all"))}
    text = divergence(off, range(2))
    assert "no fingerprints to compare" in text and "rank 1 waits in all_to_all(group=ep" in text, text
    old = [("all_reduce", (3,), None)] + [("all_reduce", (4,), None)] * 4
    window = divergence({0: _report(old), 1: _report([("all_reduce", (4,), None)] * 5, rank=1)}, range(2))
    assert "the fingerprints differ before the last 4 collectives" in window
