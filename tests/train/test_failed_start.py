"""A start that fails on a bad config or data path writes nothing (`dropless train --set
'data.sources=["/nonexistent"]'` must print a clear error and leave no run directory behind).
Driven through the CLI entry point, in a temporary working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from dropless.train.run import main

BAD_STARTS = {
    "missing data": (['data.sources=["/nonexistent"]'], "corpus source not found"),
    "vocab below the tokenizer's": (["model.vocab_size=100"], "model.vocab_size=100"),
    "too little data": (["data.max_bytes=2000"], "fewer than train.seq_len"),
}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in root.rglob("*")}


@pytest.mark.parametrize("case", sorted(BAD_STARTS))
def test_failed_start_writes_nothing(tmp_path: Path, monkeypatch, capsys, case: str) -> None:
    overrides, message = BAD_STARTS[case]
    monkeypatch.chdir(tmp_path)
    args = [a for o in overrides for a in ("--set", o)]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert _tree(tmp_path) == {}  # no runs/<preset>-<time> folder

    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("keep me")
    assert main(args + ["--run-dir", str(existing)]) == 2
    assert _tree(tmp_path) == {"mine": b"<dir>", "mine/notes.txt": b"keep me"}

    assert main(args + ["--run-dir", str(tmp_path / "new" / "run")]) == 2
    assert not (tmp_path / "new").exists()
