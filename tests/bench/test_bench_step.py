"""`dropless bench step`: the trainer's step of two configs side by side, and the profile split."""

from __future__ import annotations

import time

import pytest
import torch

from dropless.bench import step, step_profile
from tiny_run import TINY

SMALL = [o for o in TINY if not o.startswith(("model.d_ff_dense", "log.log_every", "model.n_layers"))] + [
    "model.d_ff_dense=64", "log.log_every=2", "train.optimizer=muon"]


def test_nested_ranges_charge_self_time() -> None:
    """A part inside another is taken out of the outer one's share (the experts inside the MoE layer)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("bench.step"):
            with torch.profiler.record_function("routing"):
                time.sleep(0.03)
                with torch.profiler.record_function("ffn_gemms"):
                    time.sleep(0.06)
            time.sleep(0.01)
    shares = step_profile.split(prof.events(), torch.device("cpu"), ("routing", "ffn_gemms"))
    assert shares["ffn_gemms"] == pytest.approx(0.6, abs=0.05)
    assert shares["routing"] == pytest.approx(0.3, abs=0.05)


def test_moe_against_dense_rows_and_split() -> None:
    out = step.run(["tiny", "dense"], SMALL, repeats=1, warmup=0)
    moe, dense = out["rows"]
    assert (moe["config"], dense["config"]) == ("tiny", "dense")
    assert dense["ratio"] == 1.0 and moe["ratio"] == pytest.approx(moe["step_ms"] / dense["step_ms"])
    assert moe["tokens_per_step"] == dense["tokens_per_step"] == 4 * 32
    for row in (moe, dense):
        shares = [row[f"{p}_share"] for p in (*step.PARTS, "other")]
        assert all(0 <= s <= 1 for s in shares) and sum(shares) == pytest.approx(1.0, abs=1e-6)
        assert row["attention_share"] > 0 and row["ffn_gemms_share"] > 0 and row["optimizer_share"] > 0
    # the dense preset has no MoE layer and no routing monitor work
    assert dense["routing_share"] == 0 and moe["routing_share"] > 0
    assert moe["monitor_share"] > 0
    assert out["meta"]["log_every"] == [2, 2]


def test_cli_refuses_bad_counts(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        step.main(["--repeats", "0"])
    assert "--repeats=0" in capsys.readouterr().err
