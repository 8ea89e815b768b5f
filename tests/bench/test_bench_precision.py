"""Smoke test of `dropless bench precision`: two precisions, two steps each, on the training tests'
tiny model (d=32: the smallest width that mxfp8's 32-element blocks divide)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from dropless.bench import precision as bench
from dropless.config import load_config
from dropless.model import MoEModel
from dropless.runs.presets import preset_path

TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32",
    "model.d_ff_dense=64", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.d_expert=32",
    "train.batch_size=4", "train.seq_len=32", "train.eval_batches=1", "data.max_bytes=100000",
    "log.progress=false",
]


@pytest.mark.slow
def test_bench_precision_smoke(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["--steps", "2", "--precisions", "bf16,mxfp8", "--out", str(tmp_path / "runs"),
            "--json", str(tmp_path / "rows.json"), "--time-repeats", "1"]
    for item in TINY:
        args += ["--set", item]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "interleaved" in out and "adamw_bf16" in out
    record = json.loads((tmp_path / "rows.json").read_text())
    rows = {r["precision"]: r for r in record["rows"]}
    assert set(rows) == {"bf16", "mxfp8"}
    base = rows["bf16"]
    for precision, row in rows.items():
        # each row against its own run: the precision it ran, its last losses, its step times
        run = tmp_path / "runs" / precision
        assert f'precision = "{precision}"' in (run / "config.toml").read_text()
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        train = [m for m in metrics if "loss" in m]
        assert len(train) == 2 and row["step_ms"] > 0
        assert row["val_loss"] == [m["val_loss"] for m in metrics if "val_loss" in m][-1]
        assert row["train_loss"] == train[-1]["loss"]
        assert row["run_step_ms"] == statistics.median(m["step_ms"] for m in train[1:])
        # the gaps to bf16 from the absolute figures
        assert row["rel_to_bf16"] == pytest.approx(row["val_loss"] / base["val_loss"] - 1, rel=1e-9, abs=1e-15)
        assert row["step_ms_rel_to_bf16"] == pytest.approx(row["step_ms"] / base["step_ms"], rel=1e-12)
    # same seed, data and weights: only the expert precision differs, and it must change the numbers
    assert rows["mxfp8"]["val_loss"] != base["val_loss"]
    state = record["optimizer_state_bytes"]
    # Two fp32 moments become two bf16 moments; both keep a 4-byte step tensor per parameter tensor,
    # so the moments' bytes halve exactly.
    steps = 4 * len(list(MoEModel(load_config(preset_path("tiny"), TINY).model).parameters()))
    assert state["adamw_bf16"] - steps == (state["adamw"] - steps) / 2


def test_steps_scale_the_schedule() -> None:
    # 150 of the tiny preset's 600 steps: warmup 50 -> 12 (12.5 rounds to even), evals 100 -> 25.
    configs = bench.build_configs(preset_path("tiny"), ["bf16", "nvfp4"], 150, ["train.ckpt_every=1000"])
    t = configs["nvfp4"].train
    assert (t.steps, t.warmup_steps, t.eval_every, t.ckpt_every) == (150, 12, 25, 1000)
    assert configs["nvfp4"].model.moe.precision == "nvfp4" and configs["bf16"].model.moe.precision == "bf16"
    assert configs["bf16"].model == load_config(preset_path("tiny")).model


def test_bad_arguments(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--precisions", "fp16"]) == 2
    assert "fp16" in capsys.readouterr().err
    assert bench.main(["--steps", "0"]) == 2
    assert bench.main(["--time-repeats", "-1"]) == 2
    assert bench.main(["--skip-train", "--time-repeats", "0"]) == 2  # nothing to do
