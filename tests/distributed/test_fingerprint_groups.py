"""Collective fingerprints when the world holds several groups of one role (world > ep_size): each rank
issues its EP all-to-alls on its own EP group, so the ranks' groups have different members by design.
The fingerprint hashes what every rank must agree on, the group's role and size, not its members
(distributed/fingerprint.py); the members stay in each entry for the diagnosis."""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_harness import run_world
from dropless.distributed.fingerprint import CollectiveLog, divergence
from dropless.train.loop import Trainer
from tiny_run import tiny


def _log(ranks: tuple[int, ...], shape: tuple[int, ...] = (4,)) -> CollectiveLog:
    log = CollectiveLog()
    log.record("all_to_all", "ep", ranks, "float32", shape, 0)
    log.record("all_reduce", "dp", (0, 1, 2, 3), "float32", (4,), 0)
    return log


def test_groups_of_one_role_and_size_hash_alike() -> None:
    """World 4, ep_size 2: ranks 0 and 2 sit in EP groups [0, 1] and [2, 3]. Same collectives: same
    digest, no divergence. A different group size or shape still differs, and the message still
    names each rank's members."""
    a, b = _log((0, 1)), _log((2, 3))
    assert a.digest == b.digest
    assert divergence({0: a.report(0, 0, "-", None), 2: b.report(2, 0, "-", None)}, (0, 2)) is None
    assert _log((0,)).digest != _log((0, 1)).digest  # a group of another size
    assert _log((0, 1), (5,)).digest != a.digest
    c = _log((2, 3), (5,))
    text = divergence({0: a.report(0, 0, "-", None), 2: c.report(2, 0, "-", None)}, (0, 2))
    assert "rank 0 issued #0 all_to_all(group=ep ranks=[0, 1]" in text, text
    assert "rank 2 issued #0 all_to_all(group=ep ranks=[2, 3], float32[5]" in text, text


def _train(rank: int, world: int, root: Path, ep_size: int) -> None:
    cfg = tiny(f"parallel.ep_size={ep_size}", "parallel.check_collectives=true", "train.steps=2",
               "train.eval_every=2", "train.ckpt_every=2", "train.eval_batches=1", "log.log_every=1")
    Trainer(cfg, root / "run").fit()  # a mismatch raises CollectiveMismatchError on every rank
    (root / f"rank{rank}.done").write_text("")


@pytest.mark.slow
@pytest.mark.parametrize("world,ep_size", [(2, 1), (4, 2)])
def test_world_beyond_one_ep_group_checks_collectives(tmp_path: Path, world: int, ep_size: int) -> None:
    """World 2 without expert parallelism (ep_size 1: two EP groups of one rank each), and world 4
    with EP groups [0, 1] and [2, 3], train with `check_collectives` on: the fingerprints compared at
    every log step agree. Hashing the groups' members made the first check fail with a false
    mismatch at the first EP all-to-all."""
    run_world(_train, world, tmp_path, tmp_path, ep_size)
    assert all((tmp_path / f"rank{r}.done").exists() for r in range(world))
