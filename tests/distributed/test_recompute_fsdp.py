"""Activation recompute under FSDP2 (world 2, gloo, CPU, no expert parallelism): the same bits as
without it at the same world size, since a recomputed block runs the same kernels on the same inputs
(tests/test_recompute.py checks one process). With expert parallelism: test_recompute_ep.py."""

from __future__ import annotations

from pathlib import Path

from dist_harness import run_world
from dropless.train.loop import Trainer
from tiny_run import rows, tiny

SHORT = ["train.steps=4", "train.eval_every=4", "train.ckpt_every=4"]


def _train_both(rank: int, world: int, root: Path) -> None:
    Trainer(tiny(*SHORT), root / "plain").fit()
    Trainer(tiny(*SHORT, 'model.recompute=["layer"]'), root / "layer").fit()


def test_fsdp_layer_recompute_losses_identical(tmp_path: Path) -> None:
    run_world(_train_both, 2, tmp_path, tmp_path)
    plain = rows(tmp_path / "plain", "loss")
    assert len(plain) == 4 and plain == rows(tmp_path / "layer", "loss")
