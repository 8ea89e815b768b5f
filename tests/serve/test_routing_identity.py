"""Routing records of a run with identity experts (`model.moe.n_identity_experts`): their ids (E .. E+Z-1)
are routing ids like any other, so `generate --record-routing` writes them, the RL loop
(`train --resume --replay-routing`) replays them, and `record-routing` records the same tokens again.
The record's id range is the model's selectable experts (expert_slots.py) and its header says how
many of them are identity experts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dropless.cli import main as cli
from dropless.expert_slots import ExpertSlots
from dropless.model import MoEModel
from dropless.data.routing_record import RoutingRecord
from dropless.train.loop import Trainer
from dropless.train.run import main as train_main
from tiny_run import TINY, tiny

E, Z = 4, 2
IDENT = (f"model.moe.n_identity_experts={Z}",)
# prompts whose greedy continuations route some pairs to the identity experts (asserted below, so a
# change of the tiny run that stops choosing them shows here instead of passing vacuously)
PROMPTS = ("hello world", "the cat sat", "def main():")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("identity") / "run"
    Trainer(tiny(*IDENT, "train.steps=2", "train.ckpt_every=2", "train.eval_every=2"), run).fit()
    return run


def test_generate_records_identity_ids_that_replay_and_record_again(run_dir: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    rec_path = tmp_path / "gen.rec"
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    assert cli(["generate", "--run-dir", str(run_dir), "--device", "cpu", "--temperature", "0",
                "--max-new-tokens", "12", *prompts, "--record-routing", str(rec_path)]) == 0
    rec = RoutingRecord.load(rec_path)
    assert (rec.num_experts, rec.identity_experts) == (E + Z, Z)
    assert any(bool((ids >= E).any()) for ids in rec.ids)  # identity experts were chosen and recorded

    # the RL loop: the run continues on the rollout's record, identity ids imposed like any other
    run = tmp_path / "rl"
    shutil.copytree(run_dir, run)
    sets = [a for s in (*TINY, *IDENT) for a in ("--set", s)]
    assert train_main([*sets, "--run-dir", str(run), "--resume", "--replay-routing", str(rec_path),
                       "--set", "train.steps=4", "--set", "train.threads=1"]) == 0
    assert "routing replay" in capsys.readouterr().out

    # the same tokens recorded again through the full forward of the continued run
    again = tmp_path / "again.rec"
    assert cli(["record-routing", "--run-dir", str(run), "--from", str(rec_path), "--out", str(again)]) == 0
    other = RoutingRecord.load(again)
    assert (other.num_experts, other.identity_experts) == (E + Z, Z)
    assert all(torch.equal(a, b) for a, b in zip(rec.tokens, other.tokens))


def test_the_header_carries_the_identity_experts_and_replay_checks_them(tmp_path: Path) -> None:
    model = MoEModel(tiny(*IDENT).model)
    ids = [torch.tensor([[[0, 5], [4, 1]]])]
    rec = RoutingRecord.for_model(model, [torch.arange(2)], ids, "hand-made")
    assert (rec.num_experts, rec.identity_experts) == (E + Z, Z)
    back = RoutingRecord.from_bytes(rec.to_bytes())
    assert back.identity_experts == Z and torch.equal(back.ids[0], ids[0])
    back.check_model(model.cfg, model.expert_slots())
    # the same id range from more routed experts and fewer identity ones means other experts
    with pytest.raises(ValueError, match="header field identity_experts=2 .*model.moe.n_identity_experts"):
        back.check_model(model.cfg, ExpertSlots(5, 1))
    # a record without identity experts keeps the header (and so the bytes and fingerprint) it had
    plain = RoutingRecord.for_model(MoEModel(tiny().model), [torch.arange(2)], [torch.zeros(1, 2, 2)], "x")
    assert "identity_experts" not in plain.header() and plain.identity_experts == 0
