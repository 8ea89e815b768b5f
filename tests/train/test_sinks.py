"""The run's JSONL logs: cutting them back on resume never loses the history on a crash."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dropless.runs.sinks import JsonlLog


def test_truncate_keeps_earlier_rows_and_a_crash_mid_cut_loses_nothing(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    log = JsonlLog(tmp_path / "metrics.jsonl")
    for step in range(6):
        log.write({"step": step, "loss": float(step)})
    before = log.path.read_text()
    log.truncate_from(4)
    assert [r["step"] for r in log.read()] == [0, 1, 2, 3]

    # the machine dies after the new content is written but before it is published: an in-place
    # rewrite would already have cut (or emptied) the file
    log.path.write_text(before)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("power loss")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        log.truncate_from(2)
    assert log.path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left behind
    assert json.loads(before.splitlines()[-1])["step"] == 5
