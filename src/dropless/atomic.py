"""Atomic writes: a file or a folder appears whole under its name, or not at all.

Everything is written under a hidden temporary name in the target's own folder and renamed into
place at the end. A rename within one filesystem is atomic (rename(2), `os.replace`), so a reader
sees the old content or the new, never a partial file, and a failure (an exception, a full disk)
removes the temporary and leaves the target as it was. The temporary is a sibling, not a file under
/tmp, because a rename across filesystems is a copy. A process killed outright (SIGKILL, power loss)
can leave the temporary behind: its name, `.NAME.tmp-<pid>-<random>`, says what it was, and nothing
that reads NAME opens it. The pid and the random part keep two writers of one target (two
processes, two threads) from sharing a temporary.

`fsync=True` (checkpoints, routing records) also makes the write durable: the data reaches the disk
before the rename and the folder entry after it. Without the first, a power loss after the rename
can leave the name pointing at a file whose bytes were never written (the zero-length file of
delayed allocation); without it the write is atomic for readers only, enough for a report's json.

Folders: `build_dir` yields a hidden sibling folder to fill and renames it into place when the block
ends (packed runs, imported runs, exported checkpoints); `publish_dir` is the rename alone, for a
folder written by several processes (the trainer's checkpoints) or that replaces an existing one.

`require_empty_dir` is the refusal every command that writes a new folder makes first.

Standard library only: every package imports it, the lowest ones included.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "build_dir", "fsync_dir", "publish_dir", "require_empty_dir", "temp_sibling",
           "write_bytes", "write_text"]


def temp_sibling(path: str | Path, kind: str = "tmp") -> Path:
    """A hidden name beside `path`, unique to this process and call: `.NAME.<kind>-<pid>-<random>`."""
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(path: str | Path) -> None:
    """Persist the entries (new names) of a folder; a no-op where folders cannot be opened (Windows)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_write(path: str | Path, mode: str = "w", *, fsync: bool = False) -> Iterator[IO[Any]]:
    """Yield a file open on a hidden temporary beside `path` ("w": text in UTF-8, "wb": bytes);
    when the block ends normally it replaces `path`, when it raises `path` is untouched and the
    temporary is gone. The folder of `path` must exist."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode={mode!r}: must be 'w' or 'wb'")
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        # "x": a name that exists already is an error, never a file opened over someone else's
        with open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else "utf-8") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if fsync:
        fsync_dir(path.parent)


def write_text(path: str | Path, text: str, *, fsync: bool = False) -> Path:
    """`path.write_text(text)`, atomically (module note)."""
    with atomic_write(path, "w", fsync=fsync) as f:
        f.write(text)
    return Path(path)


def write_bytes(path: str | Path, data: bytes, *, fsync: bool = False) -> Path:
    """`path.write_bytes(data)`, atomically (module note)."""
    with atomic_write(path, "wb", fsync=fsync) as f:
        f.write(data)
    return Path(path)


def publish_dir(tmp: str | Path, final: str | Path, *, replace: bool = False, fsync: bool = False) -> Path:
    """Rename the finished folder `tmp` to `final` (the same parent folder). `final` may be absent or
    an empty folder (removed first: a rename cannot replace a folder on every OS); with `replace` a
    full one is moved aside, `tmp` renamed in, then the old one deleted, so in between `final` is
    briefly absent, never half-written. `fsync`: persist `tmp`'s entries before the rename and the
    parent's after (the files in `tmp` are the caller's to fsync)."""
    tmp, final = Path(tmp), Path(final)
    if fsync:
        fsync_dir(tmp)
    old = None
    if final.exists():
        if replace:
            old = temp_sibling(final, "old")
            os.replace(final, old)
        else:
            final.rmdir()  # an OSError if it is not empty: the callers refused that before writing
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old)
    if fsync:
        fsync_dir(final.parent)
    return final


@contextmanager
def build_dir(final: str | Path) -> Iterator[Path]:
    """Yield a new hidden folder beside `final` (its parents are created) to write into; when the
    block ends normally it becomes `final` (absent or an empty folder; `publish_dir`), when it raises
    it is deleted and `final` is untouched."""
    final = Path(final)
    tmp = temp_sibling(final)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        publish_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def require_empty_dir(path: str | Path, flag: str = "--out") -> None:
    """The refusal of a folder to write that already holds something (or is a file), as
    `flag='PATH': ...`, before anything is written."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{flag}={str(path)!r}: exists and is not an empty folder; choose a new path")
