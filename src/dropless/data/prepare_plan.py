"""The work units of `dropless prepare-data`: source files cut and grouped into pieces of ~unit_bytes.

Design notes
- A unit is the grain of parallelism and of resume: a worker process tokenises one unit into its
  own shard files, and a finished unit is never redone. Units are ~`unit_bytes` of source
  (16 MiB by default): small files are grouped (in source order) until a unit is full, and big
  JSONL and Parquet/Arrow files are cut into pieces, so two workers share a big file.
- A JSONL file is cut at line ends: from each target offset the planner reads on to the next
  b"\\n", and counts the newlines before it, so a piece knows the number of its first line and its
  documents are named `name:lineno` as when the file is read whole (corpus.jsonl_documents). This
  reads each big JSONL file once (a newline count, at disk speed) and writes nothing.
- A table is cut into row ranges of about `unit_bytes` (the file's size over its rows); its
  schema is checked here (tables.table_rows), before anything is written.
- A text file is one document and cannot be cut: a text file larger than a unit is a unit alone.
- The plan is a pure function of the sources' files, their sizes and `unit_bytes`, never of the
  number of workers, so any number of workers writes the same shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .corpus import SourceFile, file_kind
from .tables import table_rows

__all__ = ["Piece", "Unit", "plan_units", "DEFAULT_UNIT_BYTES"]

DEFAULT_UNIT_BYTES = 16 << 20
_SCAN = 1 << 20


class Piece(NamedTuple):
    """A part of one source file: a whole text file, JSONL bytes [start, stop), or table rows."""

    path: str
    name: str  # the document name (JSONL, tables: its prefix)
    kind: str  # "text" | "jsonl" | "table"
    start: int  # JSONL: byte offset; table: first row; text: 0
    stop: int  # JSONL: end offset (after a newline or at the end); table: end row; text: file size
    first_line: int  # JSONL: number of the line at `start`; otherwise 1
    nbytes: int  # source bytes it covers (grouping, progress)


class Unit(NamedTuple):
    index: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def _next_line_start(f, offset: int, size: int) -> int:
    """The offset just after the first b"\\n" at or after `offset` (or `size`)."""
    f.seek(offset)
    pos = offset
    while block := f.read(_SCAN):
        i = block.find(b"\n")
        if i >= 0:
            return pos + i + 1
        pos += len(block)
    return size


def _count_newlines(f, start: int, stop: int) -> int:
    f.seek(start)
    n, left = 0, stop - start
    while left > 0:
        block = f.read(min(_SCAN, left))
        n += block.count(b"\n")
        left -= len(block)
    return n


def _jsonl_pieces(path: Path, name: str, size: int, unit_bytes: int) -> list[Piece]:
    pieces: list[Piece] = []
    start, line = 0, 1
    with open(path, "rb") as f:
        while start < size:
            stop = size if start + unit_bytes >= size else _next_line_start(f, start + unit_bytes, size)
            pieces.append(Piece(str(path), name, "jsonl", start, stop, line, stop - start))
            line += _count_newlines(f, start, stop) if stop < size else 0
            start = stop
    return pieces


def _table_pieces(path: Path, name: str, size: int, text_field: str, unit_bytes: int) -> list[Piece]:
    rows = table_rows(path, text_field)
    per = max(1, rows * unit_bytes // max(size, 1))
    return [Piece(str(path), name, "table", lo, min(lo + per, rows), 1,
                  size * (min(lo + per, rows) - lo) // max(rows, 1))
            for lo in range(0, rows, per)]


def file_pieces(f: SourceFile, text_field: str, unit_bytes: int) -> list[Piece]:
    size = f.path.stat().st_size
    kind = file_kind(f.path)
    if kind == "jsonl":
        return _jsonl_pieces(f.path, f.name, size, unit_bytes)
    if kind == "table":
        return _table_pieces(f.path, f.name, size, text_field, unit_bytes)
    return [Piece(str(f.path), f.name, "text", 0, size, 1, size)] if size else []


def plan_units(files: list[SourceFile], text_field: str, unit_bytes: int = DEFAULT_UNIT_BYTES) -> list[Unit]:
    """The units of `files` (corpus.source_files), in source order; nothing is written."""
    if unit_bytes <= 0:
        raise ValueError(f"unit_bytes must be positive, got unit_bytes={unit_bytes}")
    units: list[Unit] = []
    group: list[Piece] = []
    filled = 0
    for f in files:
        for piece in file_pieces(f, text_field, unit_bytes):
            if group and filled + piece.nbytes > unit_bytes:
                units.append(Unit(len(units), tuple(group)))
                group, filled = [], 0
            group.append(piece)
            filled += piece.nbytes
    if group:
        units.append(Unit(len(units), tuple(group)))
    return units
