"""Serving a run trained with activation recompute: `model.recompute` is a training setting, so the
serving flags (which set a norm_top_k, refused with recompute moe/layer for the backward's sake) must
still load and run the model; a serving setting the model cannot run is still refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dropless.serve import evaluate_cli
from dropless.serve.generate_cli import main as generate_main
from dropless.runs.load import load_model
from dropless.data.routing_record import RoutingRecord
from dropless.serve.serving import serving_map
from dropless.train.loop import Trainer
from tiny_run import tiny


@pytest.fixture(scope="module", params=['["moe"]', '["layer"]'])
def run_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("run")
    Trainer(tiny("train.steps=2", "train.eval_every=2", "train.ckpt_every=2",
                 f"model.recompute={request.param}"), path).fit()
    return path


def test_evaluate_serves_fewer_experts(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "one.json"
    assert evaluate_cli.main(["--run-dir", str(run_dir), "--serve-top-k", "1", "--max-batches", "1",
                              "--device", "cpu", "--json", str(out)]) == 0, capsys.readouterr().err
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["k1"], row["k2"]) == (1, 2) and row["val_loss"] > 0
    _, cfg = load_model(run_dir, model_cfg=serving_map(1))
    assert cfg.model.moe.router.norm_top_k == 2 and cfg.model.recompute == []


def test_evaluate_sweep(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sweep.json"
    assert evaluate_cli.main(["--run-dir", str(run_dir), "--serve-sweep", "--max-batches", "1",
                              "--device", "cpu", "--json", str(out)]) == 0, capsys.readouterr().err
    assert len(json.loads(out.read_text())["rows"]) == 4


def test_generate_serves_fewer_experts(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rec = tmp_path / "k1.rec"
    assert generate_main(["--run-dir", str(run_dir), "--device", "cpu", "--temperature", "0",
                          "--max-new-tokens", "4", "--prompt", "def ", "--serve-top-k", "1",
                          "--record-routing", str(rec)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("def ")
    assert RoutingRecord.load(rec).ids[0].shape[-1] == 1


@pytest.mark.parametrize("argv,match", [
    (["--serve-top-k", "5"], "--serve-top-k=5 (k1): exceeds model.moe.num_experts=4"),
    (["--serve-top-k", "1", "--serve-norm-top-k", "5"], "--serve-norm-top-k=5 (k2): exceeds "
     "model.moe.num_experts=4"),
])
def test_incompatible_settings_still_refused(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                             argv: list[str], match: str) -> None:
    assert evaluate_cli.main(["--run-dir", str(run_dir), "--device", "cpu"] + argv) == 2
    assert match in capsys.readouterr().err
    assert generate_main(["--run-dir", str(run_dir), "--device", "cpu", "--prompt", "a"] + argv) == 2
    assert match in capsys.readouterr().err
