"""atomic.py: a file or folder appears whole under its name or not at all, a failure leaves the old
content and no temporary, and a reader in the middle of a write sees the old content."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest

from dropless import atomic


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@contextmanager
def _in_place(path: Path, mode: str = "w", **_: Any) -> Iterator[IO[Any]]:
    """A writer that is not atomic: what the reader check below must catch."""
    with open(path, mode) as f:
        yield f


def _reader_sees(write: Callable[..., Any], path: Path) -> str:
    """What a reader gets from `path` while `write` is halfway through replacing "old" by "new-new"."""
    path.write_text("old")
    with write(path, "w") as f:
        f.write("new")
        f.flush()  # the half written so far is on its way to the disk, as a slow writer's would be
        seen = path.read_text()
        f.write("-new")
    assert path.read_text() == "new-new"
    return seen


def test_a_reader_in_the_middle_of_a_write_sees_the_old_content(tmp_path: Path) -> None:
    assert _reader_sees(atomic.atomic_write, tmp_path / "a.json") == "old"
    # the check can fail: a writer in place shows the reader half the new content
    assert _reader_sees(_in_place, tmp_path / "b.json") == "new"


def test_a_failure_in_the_middle_keeps_the_old_content_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    path.write_text("old")
    for mode, half in (("w", "half"), ("wb", b"half")):
        with pytest.raises(RuntimeError, match="disk full"):
            with atomic.atomic_write(path, mode) as f:
                f.write(half)
                raise RuntimeError("disk full")
        assert path.read_text() == "old"
        assert _names(tmp_path) == ["out.json"]
    with pytest.raises(TypeError):  # an error in the caller's own data: the same
        atomic.write_text(path, None)  # type: ignore[arg-type]
    assert path.read_text() == "old" and _names(tmp_path) == ["out.json"]


def test_text_and_bytes_replace_the_file_and_leave_only_it(tmp_path: Path) -> None:
    assert atomic.write_text(tmp_path / "t.json", "é\n") == tmp_path / "t.json"
    assert (tmp_path / "t.json").read_bytes() == "é\n".encode()  # UTF-8 whatever the locale
    atomic.write_bytes(tmp_path / "b.bin", b"\x00\x01")
    atomic.write_bytes(tmp_path / "b.bin", b"\x02")
    assert (tmp_path / "b.bin").read_bytes() == b"\x02"
    assert _names(tmp_path) == ["b.bin", "t.json"]
    with pytest.raises(FileNotFoundError):  # the folder must exist; nothing is created
        atomic.write_text(tmp_path / "missing" / "x.json", "{}")
    assert _names(tmp_path) == ["b.bin", "t.json"]
    with pytest.raises(ValueError, match="mode='a'"):
        with atomic.atomic_write(tmp_path / "x", "a"):
            pass


def test_the_temporary_is_hidden_beside_the_target_and_unique(tmp_path: Path) -> None:
    seen = []
    with atomic.atomic_write(tmp_path / "r.json") as f:
        seen.append(Path(f.name))
    with atomic.atomic_write(tmp_path / "r.json") as f:
        seen.append(Path(f.name))
    for tmp in seen:
        assert tmp.parent == tmp_path and tmp.name.startswith(f".r.json.tmp-{os.getpid()}-")
    assert seen[0] != seen[1]  # one name per write: two writers never share a temporary


def test_fsync_syncs_the_file_before_the_rename_and_the_folder_after(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to name what was synced")
    path, events = tmp_path / "latest", []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.path.basename(os.readlink(
        f"/proc/self/fd/{fd}")))) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", Path(b).name)) or real_replace(a, b))
    atomic.write_bytes(path, b"step_000001\n", fsync=True)
    assert events[0][0] == "fsync" and events[0][1].startswith(".latest.tmp-")
    assert events[1:] == [("replace", "latest"), ("fsync", tmp_path.name)]
    events.clear()
    atomic.write_bytes(path, b"x")
    assert events == [("replace", "latest")]


def test_build_dir_publishes_whole_or_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "run"
    with atomic.build_dir(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".run.tmp-")
        (tmp / "a.txt").write_text("a")
        assert not out.exists()  # nothing under the name until the block ends
    assert _names(out) == ["a.txt"] and _names(out.parent) == ["run"]

    failed = tmp_path / "failed"
    with pytest.raises(OSError, match="disk full"):
        with atomic.build_dir(failed) as tmp:
            (tmp / "half.txt").write_text("half")
            raise OSError("disk full")
    assert _names(tmp_path) == ["deep"]

    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic.build_dir(empty) as tmp:
        (tmp / "b.txt").write_text("b")
    assert _names(empty) == ["b.txt"]
    with pytest.raises(OSError):  # a full folder is never replaced (the commands refused it first)
        with atomic.build_dir(empty) as tmp:
            (tmp / "c.txt").write_text("c")
    assert _names(empty) == ["b.txt"] and _names(tmp_path) == ["deep", "empty"]


def test_publish_dir_replaces_a_full_folder_and_keeps_no_old_copy(tmp_path: Path) -> None:
    final, new = tmp_path / "step_000010", tmp_path / ".tmp-step_000010-1"
    final.mkdir()
    (final / "state.pt").write_text("old")
    new.mkdir()
    (new / "state.pt").write_text("new")
    assert atomic.publish_dir(new, final, replace=True, fsync=True) == final
    assert (final / "state.pt").read_text() == "new" and _names(tmp_path) == ["step_000010"]


def test_require_empty_dir_names_the_flag_and_the_path(tmp_path: Path) -> None:
    atomic.require_empty_dir(tmp_path / "absent")
    atomic.require_empty_dir(tmp_path)  # empty
    (tmp_path / "keep").write_text("x")
    with pytest.raises(ValueError, match="^" + re.escape(f"--out='{tmp_path}': exists and is not an empty folder")):
        atomic.require_empty_dir(tmp_path)
    # a file is not a folder
    with pytest.raises(ValueError, match="^" + re.escape(f"--dir='{tmp_path / 'keep'}': exists")):
        atomic.require_empty_dir(tmp_path / "keep", "--dir")
