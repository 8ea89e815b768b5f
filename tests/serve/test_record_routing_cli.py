"""`dropless record-routing` on a trained tiny run: validation windows, a text file, a record's tokens;
what a user would then compare with `dropless routing-mismatch`; bad input writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dropless.cli import main as cli
from dropless.data.routing_record import RoutingRecord
from dropless.train.loop import Trainer
from tiny_run import tiny


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run")
    Trainer(tiny("model.n_layers=3", "train.steps=2", "train.ckpt_every=2", "train.eval_every=2"), run).fit()
    return run


def test_record_then_compare(run_dir: Path, tmp_path: Path, capsys) -> None:
    fp32, bf16 = tmp_path / "fp32.rec", tmp_path / "bf16.rec"
    assert cli(["record-routing", "--run-dir", str(run_dir), "--val", "3", "--seq-len", "16",
                "--out", str(fp32)]) == 0
    rec = RoutingRecord.load(fp32)
    assert [t.numel() for t in rec.tokens] == [16] * 3 and rec.ids[0].shape == (2, 16, 2)
    assert rec.source == "full forward fp32" and rec.model["step"] == 2 and rec.moe_layers == [1, 2]
    # the same tokens again, from the record, in bf16
    assert cli(["record-routing", "--run-dir", str(run_dir), "--from", str(fp32), "--dtype", "bf16",
                "--out", str(bf16)]) == 0
    other = RoutingRecord.load(bf16)
    assert other.source == "full forward bf16"
    assert all(torch.equal(a, b) for a, b in zip(rec.tokens, other.tokens))
    capsys.readouterr()
    assert cli(["routing-mismatch", str(fp32), str(fp32), "--json", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["tokens_with_any_mismatch"] == 0
    assert cli(["routing-mismatch", str(fp32), str(bf16)]) == 0
    assert "48 tokens compared" in capsys.readouterr().out


def test_text_file_source_and_bad_input(run_dir: Path, tmp_path: Path, capsys) -> None:
    text = tmp_path / "prompts.txt"
    text.write_text("hello there\n\nsecond prompt, longer\n")
    out = tmp_path / "t.rec"
    assert cli(["record-routing", "--run-dir", str(run_dir), "--from", str(text), "--out", str(out)]) == 0
    rec = RoutingRecord.load(out)
    assert [bytes(t.tolist()).decode() for t in rec.tokens] == ["hello there", "second prompt, longer"]
    text.write_text("x" * 40 + "\n")  # longer than model.max_seq_len = 32
    bad = tmp_path / "bad.rec"
    for args, message in (
            (["--from", str(text)], "exceeds model.max_seq_len=32"),
            (["--from", str(tmp_path / "none.txt")], "no such file"),
            (["--val", "1000", "--seq-len", "16"], "--val 1000: the validation split holds only"),
            (["--val", "2", "--seq-len", "-1"], "--seq-len -1")):
        assert cli(["record-routing", "--run-dir", str(run_dir), *args, "--out", str(bad)]) == 2
        assert message in capsys.readouterr().err
        assert not bad.exists()
    assert cli(["record-routing", "--run-dir", str(tmp_path), "--val", "1", "--out", str(bad)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
