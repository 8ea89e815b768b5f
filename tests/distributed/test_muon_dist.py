"""Muon under EP + FSDP2 (gloo, CPU, world 2) against one process, DCP resume, and the buffered-EP
skip with Muon's state.

World 2 covers both sharding paths of train/muon.py: ep=2 (edp=1: each rank owns two whole experts;
dense matrices row-sharded over dp=2, gathered for Newton-Schulz) and ep=1 (edp=2: FSDP2 shards the
experts along E, still whole experts per rank). The data layout is test_parallel_train.py's: two ranks
with grad_accum 1 see one process's global batch with grad_accum 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dist_harness import run_world
from test_parallel_train import _local_state  # params and optimizer state, local shards
from dropless.runs import checkpoint as ckpt
from dropless.train.loop import Trainer
from dropless.train.muon import Muon
from dropless.train.overflow import EPOverflowError
from tiny_run import rows
from tiny_run import tiny as tiny_base
from tolerances import PARALLEL_TRAIN_GRAD_NORM, PARALLEL_TRAIN_LOSS


def tiny(*extra: str):
    return tiny_base("train.optimizer=muon", "train.eval_every=20", "train.dtype=fp32", *extra)


def metric(run_dir: Path, key: str) -> list[float]:
    return [r[key] for r in rows(run_dir, key)]


def max_rel(got: list[float], ref: list[float]) -> float:
    assert len(got) == len(ref)
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


BUFFERED_SKEW = ["model.moe.router.use_expert_bias=true", "parallel.ep_size=2", "parallel.ep_mode=buffered",
                 "parallel.ragged_buffer_factor=0.5", "train.steps=4", "parallel.retry_on_overflow=false"]


def _world(rank: int, world: int, root: Path) -> None:
    for ep in (2, 1):
        trainer = Trainer(tiny(f"parallel.ep_size={ep}"), root / f"ep{ep}")
        assert isinstance(trainer.optimizer, Muon)
        trainer.fit()
    # resume the ep=2 run from its step-10 DCP checkpoint: the same world and computation, so the
    # losses of steps 10..19 are the uninterrupted run's, bit for bit
    res = root / "resumed"
    if rank == 0:
        step10 = root / "ep2" / "checkpoints" / ckpt.checkpoint_name(10)
        shutil.copytree(step10, res / "checkpoints" / step10.name)
        kept = [line for line in (root / "ep2" / "metrics.jsonl").read_text().splitlines()
                if json.loads(line).get("step", 0) < 10]
        (res / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    torch.distributed.barrier()
    resumed = Trainer(tiny("parallel.ep_size=2"), res, resume=True)
    assert resumed.start_step == 10
    resumed.fit()
    # buffered EP with Muon: an overflowing step is skipped on the device, state untouched
    skip = Trainer(tiny(*BUFFERED_SKEW), root / "skip")
    for layer in skip.model.moe_layers():  # every token to rank 0's experts: 4x the link capacity
        layer.router.set_bias(torch.tensor([1.0, 1.0, 0.0, 0.0]))
    before = _local_state(skip)
    skip.train_step(0)
    assert all(torch.equal(a, b) for a, b in zip(before, _local_state(skip)))
    with pytest.raises(EPOverflowError):
        skip.overflow.check(0)


@pytest.mark.slow
def test_muon_ep_fsdp_follows_one_process_and_resumes(tmp_path: Path) -> None:
    one = tmp_path / "one"
    Trainer(tiny("train.grad_accum=2"), one).fit()
    run_world(_world, 2, tmp_path, tmp_path)
    for ep in (2, 1):
        two = tmp_path / f"ep{ep}"
        assert len(metric(two, "loss")) == 20
        assert max_rel(metric(two, "loss"), metric(one, "loss")) <= PARALLEL_TRAIN_LOSS, ep
        assert max_rel(metric(two, "grad_norm"), metric(one, "grad_norm")) <= PARALLEL_TRAIN_GRAD_NORM, ep
        assert max_rel(metric(two, "val_loss"), metric(one, "val_loss")) <= PARALLEL_TRAIN_LOSS, ep
    assert rows(tmp_path / "resumed", "loss") == rows(tmp_path / "ep2", "loss")
