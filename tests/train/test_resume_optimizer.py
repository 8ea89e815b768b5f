"""Resuming with another train.optimizer (adamw, adamw_bf16, muon): the checkpoint's weights load, its
optimizer state (another optimizer's keys) does not, the new optimizer starts fresh, and the resume
says so on stdout and in metrics.jsonl; the optimizer's settings (betas, eps, weight decay) on resume
are the new config's, not the checkpoint's param groups'."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dropless.model import MoEModel
from dropless.runs import checkpoint as ckpt
from dropless.runs import dist_checkpoint
from dropless.train.loop import Trainer
from tiny_run import rows, tiny

SHORT = ("train.eval_every=100", "train.ckpt_every=2")


def checkpoint_weights(run: Path) -> dict[str, torch.Tensor]:
    path = ckpt.latest_checkpoint(run)
    cfg = tiny(*SHORT)
    model = MoEModel(cfg.model)
    dist_checkpoint.load_full_model(path, model)
    return model.state_dict()


def state_is_fresh(optimizer: torch.optim.Optimizer) -> bool:
    """No state yet (torch's AdamW, AdamWBF16: made at the first step) or all zeros (Muon's eager
    state: zero momenta and moments, step 0)."""
    return all(not torch.is_tensor(v) or not v.any() for s in optimizer.state.values() for v in s.values())


@pytest.mark.parametrize("old,new", [("adamw", "muon"), ("muon", "adamw"), ("adamw", "adamw_bf16"),
                                     ("adamw_bf16", "adamw")])
def test_changing_the_optimizer_on_resume_starts_it_fresh(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                          old: str, new: str) -> None:
    run = tmp_path / "run"
    Trainer(tiny(*SHORT, "train.steps=2", f"train.optimizer={old}"), run).fit()
    assert not state_is_fresh(Trainer(tiny(*SHORT, "train.steps=2", f"train.optimizer={old}"), run,
                                      resume=True).optimizer)  # the same optimizer: its state loads
    saved = checkpoint_weights(run)
    capsys.readouterr()
    trainer = Trainer(tiny(*SHORT, "train.steps=4", f"train.optimizer={new}"), run, resume=True)
    out = capsys.readouterr().out
    note = f"train.optimizer changed from {old!r} to {new!r}"
    assert f"note on resume: {note}" in out and f"{new} starts from a fresh state" in out
    assert trainer.start_step == 2 and state_is_fresh(trainer.optimizer)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    trainer.fit()
    (resumed,) = [r for r in rows(run, "resumed_from") if r["config_changes"].get("train.optimizer")]
    assert resumed["config_changes"]["train.optimizer"] == [old, new] and note in resumed["notes"][0]
    losses = [r for r in rows(run, "loss") if r["step"] >= 2]
    assert [r["step"] for r in losses] == [2, 3] and all(math.isfinite(r["loss"]) for r in losses)
    # the next resume, optimizer unchanged, loads the new optimizer's state and says nothing of it
    capsys.readouterr()
    again = Trainer(tiny(*SHORT, "train.steps=4", f"train.optimizer={new}"), run, resume=True)
    assert "note on resume" not in capsys.readouterr().out and not state_is_fresh(again.optimizer)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_bf16", "muon"])
def test_optimizer_settings_on_resume_are_the_new_configs(tmp_path: Path, optimizer: str) -> None:
    Trainer(tiny(*SHORT, "train.steps=2", f"train.optimizer={optimizer}"), tmp_path).fit()
    trainer = Trainer(tiny(*SHORT, "train.steps=4", f"train.optimizer={optimizer}", "train.weight_decay=0.0",
                           "train.beta1=0.5", "train.beta2=0.9", "train.eps=1e-6"), tmp_path, resume=True)
    assert not state_is_fresh(trainer.optimizer)
    for group in trainer.optimizer.param_groups:
        assert (group["weight_decay"], tuple(group["betas"]), group["eps"]) == (0.0, (0.5, 0.9), 1e-6)
