"""One checkpoint format at every world size: a run saved by one process resumes at 4 gloo processes
(EP 2 x edp 2), which save again, and resumes at 2 processes (ep 1: every expert moves), and the
losses follow an uninterrupted one-process run.

Each phase keeps the global batch (one process x grad_accum 4 = 4 ranks x 1 = 2 ranks x 2), so what
differs from the uninterrupted run is the association of fp32 sums only (tolerances.PARALLEL_TRAIN_LOSS,
as in test_parallel_train.py). log_every=3 with ckpt_every=4: the checkpoints fall inside log
intervals, so the routing accumulators are resharded too (1 -> 4 -> 2 ranks).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from dist_harness import run_world
from dropless.model import MoEModel
from dropless.runs import checkpoint as ckpt
from dropless.runs import dist_checkpoint
from dropless.train.loop import Trainer
from tiny_run import tiny as tiny_base
from tolerances import PARALLEL_TRAIN_GRAD_NORM, PARALLEL_TRAIN_LOSS


def tiny(*extra: str):
    return tiny_base("train.steps=12", "train.eval_every=12", "train.dtype=fp32", "train.ckpt_every=4",
                     "train.keep_last=5", "log.log_every=3", *extra)


def metric(run_dir: Path, key: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if key in r]


def max_rel(got: list[float], ref: list[float]) -> float:
    assert len(got) == len(ref)
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def routing_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "routing.jsonl").read_text().splitlines()]


class _Stop(Exception):
    pass


def _resume_at_4(rank: int, world: int, run_dir: Path) -> None:
    """Resume the one-process step-4 checkpoint at 4 ranks and stop (every rank) after the step-8
    save, like a job killed there."""
    trainer = Trainer(tiny("train.grad_accum=1", "parallel.ep_size=2"), run_dir, resume=True)
    assert trainer.start_step == 4
    real_step = trainer.train_step

    def stop_at_8(step: int, *args):
        if step == 8:
            raise _Stop
        return real_step(step, *args)

    trainer.train_step = stop_at_8
    with pytest.raises(_Stop):
        trainer.fit()


def _resume_at_2(rank: int, world: int, run_dir: Path) -> None:
    trainer = Trainer(tiny("train.grad_accum=2", "parallel.ep_size=1"), run_dir, resume=True)
    assert trainer.start_step == 8
    trainer.fit()


@pytest.mark.slow
def test_checkpoint_resumes_at_any_world_size_1_4_2(tmp_path: Path) -> None:
    one = tmp_path / "one"
    Trainer(tiny("train.grad_accum=4"), one).fit()  # uninterrupted, checkpoints at 4, 8, 12

    # phase 1: what one process saved at step 4
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    step4 = one / "checkpoints" / ckpt.checkpoint_name(4)
    shutil.copytree(step4, run / "checkpoints" / step4.name)
    for name in ("metrics.jsonl", "routing.jsonl", "config.toml"):
        shutil.copy(one / name, run / name)
    run_world(_resume_at_4, 4, tmp_path, run)
    assert ckpt.latest_checkpoint(run).name == ckpt.checkpoint_name(8)
    run_world(_resume_at_2, 2, tmp_path, run)

    losses, ref = metric(run, "loss"), metric(one, "loss")
    assert [r["step"] for r in losses] == [r["step"] for r in ref] == [0, 2, 5, 8, 11]
    assert max_rel([r["loss"] for r in losses], [r["loss"] for r in ref]) <= PARALLEL_TRAIN_LOSS
    assert max_rel([r["grad_norm"] for r in losses], [r["grad_norm"] for r in ref]) <= PARALLEL_TRAIN_GRAD_NORM
    val = [r["val_loss"] for r in metric(run, "val_loss")]
    assert max_rel(val, [r["val_loss"] for r in metric(one, "val_loss")]) <= PARALLEL_TRAIN_LOSS
    resumes = [(r["step"], r["saved_world_size"], r["world_size"], r["config_changes"])
               for r in metric(run, "resumed_from")]
    assert resumes == [
        (4, 1, 4, {"parallel.ep_size": [1, 2], "train.grad_accum": [4, 1]}),
        (8, 4, 2, {"parallel.ep_size": [2, 1], "train.grad_accum": [1, 2]}),
    ]
    assert routing_steps(run) == routing_steps(one)


def _resume_with(rank: int, world: int, run_dir: Path, copy_dir: Path, optimizer: str) -> None:
    """Resume the one-process step-4 checkpoint at 2 ranks (EP 2) with another optimizer; write the
    model as loaded through the same DCP path (the parent compares it with the checkpoint), then train."""
    trainer = Trainer(tiny("train.grad_accum=1", "parallel.ep_size=2", "train.steps=6",
                           f"train.optimizer={optimizer}"), run_dir, resume=True)
    assert trainer.start_step == 4
    dist_checkpoint.save(copy_dir, 4, trainer.model, trainer.optimizer, {"step": 4},
                         experts=trainer.layout.expert_names, meshes=trainer.layout.meshes)
    trainer.fit()


def _full_model(path: Path) -> dict:
    model = MoEModel(tiny().model)
    dist_checkpoint.load_full_model(path, model)
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("old,new", [("adamw", "muon"), ("muon", "adamw")])
def test_optimizer_change_on_resume_at_world_size_2(tmp_path: Path, old: str, new: str) -> None:
    run, copy = tmp_path / "run", tmp_path / "copy"
    Trainer(tiny("train.grad_accum=2", "train.steps=4", f"train.optimizer={old}"), run).fit()
    saved = _full_model(ckpt.latest_checkpoint(run))
    run_world(_resume_with, 2, tmp_path, run, copy, new)
    loaded = _full_model(ckpt.latest_checkpoint(copy))
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    (resume,) = metric(run, "resumed_from")
    assert resume["config_changes"]["train.optimizer"] == [old, new]
    assert f"train.optimizer changed from {old!r} to {new!r}" in resume["notes"][0]
    losses = [r for r in metric(run, "loss") if r["step"] >= 4]
    assert losses and all(math.isfinite(r["loss"]) for r in losses)
