"""Corpora as lists of documents: the embedded stdlib corpus, user files/folders/JSONL, the split.

Design notes
- A document is `(name, data: bytes)`. Bytes, not str: the byte tokenizer consumes them as-is
  (no decode/encode round trip, and files that are not valid UTF-8 still train), and tokenizers
  that need text decode them with errors="replace" in `data.py`.
- The default corpus needs no download: it is the Python standard library's own `.py` sources on
  this machine (`sysconfig.get_paths()["stdlib"]`, ~12 MB for CPython 3.11), minus test folders
  (`test`, `tests`, `idle_test`) and anything under `site-packages`/`dist-packages`, which holds
  whatever the environment happens to have installed and would make the corpus machine-dependent.
  The stdlib itself still differs between Python versions, so a run records the Python version,
  not a corpus hash.
- The train/validation split is by document, from a stable hash of the document name
  (sha256; never Python's `hash()`, which is salted per process). A document keeps its split when
  others are added or removed, and the split is disjoint by construction.
- `max_bytes` caps the corpus for tests and quick runs. Documents are taken in a second, differently
  salted hash order (not path order, which would take only `__future__.py`, `_aix_support.py`, ...
  and not the split hash, whose low values are exactly the validation documents), so a capped corpus
  is a representative sample with the same val fraction in expectation. The document that crosses
  the cap is truncated, so the total is exactly `min(max_bytes, corpus size)`.
- User sources (`read_documents`): a file is one document (any suffix; `.jsonl` is parsed, one
  document per line from `text_field`); a folder is walked recursively for files whose suffix is in
  `TEXT_SUFFIXES`, skipping hidden files and folders (`.git`, ...). A suffix allowlist, rather than
  "all files", keeps binaries, images and lock files out of a corpus by default; name such a file
  explicitly to include it. Document names are relative to the source's parent folder, so moving a
  folder does not reshuffle its split. Parquet and Arrow files (`.parquet`, `.arrow`; named, never
  found by a folder walk) are read through `datasets` (`tables.py`), a document per row named
  `name:row` (0-based).
- `source_files` and `jsonl_documents` are the pieces `prepare.py` shares: it cuts big JSONL files
  into byte ranges of whole lines and reads each with the same parser, so names and errors agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from . import tables
from .tables import TABLE_SUFFIXES

__all__ = [
    "Document",
    "TEXT_SUFFIXES",
    "STDLIB_EXCLUDED_DIRS",
    "stdlib_root",
    "stdlib_files",
    "stdlib_documents",
    "read_documents",
    "source_files",
    "SourceFile",
    "file_kind",
    "file_documents",
    "jsonl_documents",
    "is_validation",
    "split_documents",
]

TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".jsonl"})
STDLIB_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


class Document(NamedTuple):
    name: str  # stable identifier; decides the split
    data: bytes


def _unit_hash(name: str, salt: str) -> float:
    """A stable, uniform value in [0, 1) for `name` (64 bits of sha256)."""
    digest = hashlib.sha256(f"{salt}\0{name}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_validation(name: str, val_fraction: float) -> bool:
    """Whether the document called `name` belongs to the validation split."""
    return _unit_hash(name, "split") < val_fraction


def _check_fraction(val_fraction: float) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got val_fraction={val_fraction!r}")


def _check_max_bytes(max_bytes: int | None) -> None:
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive int or None, got max_bytes={max_bytes!r}")


def split_documents(
    docs: Sequence[Document], val_fraction: float = 0.05
) -> tuple[list[Document], list[Document]]:
    """(train, val) by the name hash; order within each split is preserved."""
    _check_fraction(val_fraction)
    train: list[Document] = []
    val: list[Document] = []
    for d in docs:
        (val if is_validation(d.name, val_fraction) else train).append(d)
    return train, val


def _cap_order(names: Iterable[str]) -> list[int]:
    """Indices of `names` in the deterministic order used when capping with max_bytes."""
    names = list(names)
    return sorted(range(len(names)), key=lambda i: (_unit_hash(names[i], "cap"), names[i]))


def _cap(docs: list[Document], max_bytes: int | None) -> list[Document]:
    if max_bytes is None:
        return docs
    taken: dict[int, Document] = {}
    left = max_bytes
    for i in _cap_order(d.name for d in docs):
        if left <= 0:
            break
        d = docs[i]
        taken[i] = d if len(d.data) <= left else Document(d.name, d.data[:left])
        left -= len(d.data)
    return [taken[i] for i in sorted(taken)]  # back to source order


# ---------------------------------------------------------------- the embedded stdlib corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Sorted `.py` files of the standard library, without test folders or site-packages."""
    root = stdlib_root()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into excluded trees (site-packages can be huge).
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found)


def stdlib_documents(*, max_bytes: int | None = None) -> list[Document]:
    """The stdlib corpus as documents named by their path relative to the stdlib root.

    With `max_bytes`, files are read one at a time in the cap order and reading stops at the cap,
    so a small cap reads only a few files.
    """
    _check_max_bytes(max_bytes)
    root = stdlib_root()
    files = stdlib_files()
    names = [p.relative_to(root).as_posix() for p in files]
    order = _cap_order(names) if max_bytes is not None else range(len(files))
    docs: list[Document] = []
    left = max_bytes
    for i in order:
        if left is not None and left <= 0:
            break
        data = files[i].read_bytes()
        if left is not None:
            data = data[:left]
            left -= len(data)
        if data:
            docs.append(Document(names[i], data))
    if max_bytes is not None:
        docs.sort(key=lambda d: d.name)  # path order again, for readable, diffable corpora
    if not docs:
        raise ValueError(f"no text found in the stdlib corpus at {str(root)!r}")
    return docs


# ---------------------------------------------------------------- user sources


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"corpus source not found: {str(path)!r}") from None
    except OSError as e:
        raise ValueError(f"cannot read corpus file {str(path)!r}: {e}") from e


def jsonl_documents(
    path: Path, name: str, text_field: str, start: int = 0, stop: int | None = None, first_line: int = 1
) -> Iterator[Document]:
    """The documents of a `.jsonl` file's bytes [start, stop) (whole lines; `first_line` is the number
    of the line at `start`), named `name:lineno`. Lines end at b"\\n" only, as JSON Lines defines
    them (a b"\\r" before it is whitespace to the JSON parser), so a byte range cut at a newline
    numbers its lines as the whole file does."""
    if start == 0 and stop is None:
        raw = _read_bytes(path)
    else:
        with open(path, "rb") as f:
            f.seek(start)
            raw = f.read(-1 if stop is None else stop - start)
    for lineno, line in enumerate(raw.split(b"\n"), start=first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r} line {lineno}: invalid JSON ({e.msg})") from e
        if not isinstance(record, dict) or text_field not in record:
            raise ValueError(
                f"{str(path)!r} line {lineno}: no text field {text_field!r} "
                f"(set text_field to the key that holds the text)"
            )
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(
                f"{str(path)!r} line {lineno}: field {text_field!r} is "
                f"{type(text).__name__}, expected str"
            )
        if text:
            yield Document(f"{name}:{lineno}", text.encode("utf-8", "surrogateescape"))


class SourceFile(NamedTuple):
    path: Path
    name: str  # the document name (or, for JSONL and tables, its prefix)
    source: int  # index of the source (file or folder) it came from


def file_kind(path: Path) -> str:
    """How a file is read: "jsonl" (a document per line), "table" (Parquet/Arrow: a document per
    row, through `datasets`), or "text" (the whole file is one document)."""
    if path.suffix == ".jsonl":
        return "jsonl"
    return "table" if path.suffix in TABLE_SUFFIXES else "text"


def file_documents(f: SourceFile, text_field: str) -> list[Document]:
    kind = file_kind(f.path)
    if kind == "jsonl":
        return list(jsonl_documents(f.path, f.name, text_field))
    if kind == "table":
        with tempfile.TemporaryDirectory() as cache:  # datasets' arrow copy of a parquet file
            return [Document(*d) for d in tables.table_texts(f.path, f.name, text_field, cache_dir=Path(cache))]
    data = _read_bytes(f.path)
    return [Document(f.name, data)] if data else []


def _folder_files(folder: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found.extend(
            Path(dirpath) / f
            for f in filenames
            if not f.startswith(".") and Path(f).suffix in TEXT_SUFFIXES
        )
    return sorted(found)


def source_files(sources: Sequence[str | Path]) -> list[SourceFile]:
    """The files of user sources, in source order then path order, each with its document name
    (relative to the source's parent folder); FileNotFoundError naming a missing source."""
    if isinstance(sources, (str, Path)):
        sources = [sources]  # a lone path is an easy mistake; a str would iterate by character
    if not sources:
        raise ValueError("sources is empty; give at least one file or folder")
    files: list[SourceFile] = []
    for i, src in enumerate(sources):
        path = Path(src).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"corpus source not found: {str(src)!r}")
        base = path.parent
        if path.is_dir():
            files.extend(SourceFile(f, f.relative_to(base).as_posix(), i) for f in _folder_files(path))
        else:
            files.append(SourceFile(path, path.name, i))
    return files


def read_documents(
    sources: Sequence[str | Path],
    *,
    text_field: str = "text",
    max_bytes: int | None = None,
) -> list[Document]:
    """Documents from user files, folders, `.jsonl` and Parquet/Arrow files, in source order then
    path order."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    _check_max_bytes(max_bytes)
    docs: list[Document] = []
    for f in source_files(sources):
        docs.extend(file_documents(f, text_field))
    docs = _cap(docs, max_bytes)
    if not docs:
        shown = [str(s) for s in sources]
        raise ValueError(
            f"no text found in {shown} (folders are searched for {sorted(TEXT_SUFFIXES)})"
        )
    return docs
