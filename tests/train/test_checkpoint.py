"""Atomic checkpoints: round trip, crashes mid-save never surface, pruning, RNG state."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from dropless.runs import checkpoint as ckpt
from dropless.runs.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


def _state(step: int) -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"step": step, "model": model.state_dict(), "optim": opt.state_dict(), "rng": rng_state(),
            "config": {"lr": 1e-3, "name": "tiny"}}


def test_round_trip(tmp_path: Path) -> None:
    state = _state(123)
    path = save_checkpoint(tmp_path, 123, state)
    assert path == tmp_path / "checkpoints" / "step_000123"
    assert (path / "COMPLETE").is_file()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000123"
    assert latest_checkpoint(tmp_path) == path
    loaded = load_checkpoint(path)
    assert loaded["step"] == 123 and loaded["config"] == state["config"]
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert torch.equal(loaded["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
    assert torch.equal(load_checkpoint(path / "state.pt")["model"]["weight"], state["model"]["weight"])
    # No temporary leftovers after a clean save.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000123"]


def test_latest_is_highest_step_not_lexicographic(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for step in (999_999, 5, 1_000_000):  # 7 digits sort before 6 as strings
        save_checkpoint(tmp_path, step, {"step": step})
    assert latest_checkpoint(tmp_path).name == "step_1000000"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 999_999, 1_000_000]


def test_resave_same_step_replaces(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 10, {"v": 1})
    save_checkpoint(tmp_path, 10, {"v": 2})
    assert load_checkpoint(latest_checkpoint(tmp_path))["v"] == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000010"]


def test_crash_mid_save_is_never_latest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = save_checkpoint(tmp_path, 100, {"step": 100})
    real_save = torch.save

    def crash_after_partial_write(obj: object, f: object, *a: object, **kw: object) -> None:
        f.write(b"PK\x03\x04 partial")  # some bytes hit the file, then the process "dies"
        raise RuntimeError("simulated crash (disk full / SIGKILL)")

    monkeypatch.setattr(torch, "save", crash_after_partial_write)
    with pytest.raises(RuntimeError, match="simulated crash"):
        save_checkpoint(tmp_path, 200, {"step": 200})
    monkeypatch.setattr(torch, "save", real_save)

    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == [f".tmp-step_000200-{os.getpid()}"]
    assert latest_checkpoint(tmp_path) == good
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000100"
    # A later save at the same step cleans the stale temporary folder and succeeds.
    save_checkpoint(tmp_path, 200, {"step": 200})
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 200


def test_crash_before_marker_or_rename_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = save_checkpoint(tmp_path, 1, {"step": 1})
    ckdir = tmp_path / "checkpoints"
    # A folder with the final name but no marker (e.g. copied by hand, or an old non-atomic writer).
    (ckdir / "step_000050").mkdir()
    torch.save({"step": 50}, ckdir / "step_000050" / "state.pt")
    # A foreign crashed temp dir with a marker but never renamed.
    (ckdir / ".tmp-step_000060-999").mkdir()
    (ckdir / ".tmp-step_000060-999" / "COMPLETE").write_text("60\n")
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(ValueError, match="COMPLETE"):
        load_checkpoint(ckdir / "step_000050")

    # Crash while writing the marker: the rename never happens.
    def crash(path: Path, data: bytes) -> None:
        raise OSError("simulated crash writing marker")

    monkeypatch.setattr(ckpt, "_write_file_synced", crash)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 70, {"step": 70})
    assert latest_checkpoint(tmp_path) == good


def test_keep_last_prunes_oldest(tmp_path: Path) -> None:
    for step in range(0, 60, 10):
        save_checkpoint(tmp_path, step, {"step": step}, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 50]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000040", "step_000050"]
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 60, {}, keep_last=0)


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing"):
        load_checkpoint(tmp_path / "nothing")
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, -1, {})
    with pytest.raises(ValueError, match="dict"):
        save_checkpoint(tmp_path, 1, [1, 2])  # type: ignore[arg-type]


def test_rng_state_round_trip_through_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    random.seed(0)
    save_checkpoint(tmp_path, 1, {"rng": rng_state()})
    expected = (torch.rand(5), random.random())
    torch.manual_seed(123)
    random.seed(123)
    set_rng_state(load_checkpoint(latest_checkpoint(tmp_path))["rng"])
    got = (torch.rand(5), random.random())
    assert torch.equal(expected[0], got[0]) and expected[1] == got[1]
    with pytest.raises(ValueError, match="'python'"):
        set_rng_state({"torch": torch.get_rng_state()})
