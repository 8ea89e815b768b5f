"""Parquet and Arrow files as documents: a row's text field is one document, read through `datasets`.

Design notes
- `datasets` (and the `pyarrow` it brings) is optional: `import_datasets` is the one place that
  imports it, with an error saying what to install (`pip install 'dropless[data]'`).
- `.arrow` files (the Arrow stream format `datasets` itself writes: `save_to_disk`, its cache) open
  with `Dataset.from_file`, memory-mapped: rows are read where they lie, nothing is copied.
- `.parquet` files open with `Dataset.from_parquet`, which converts the file into an Arrow cache file
  once (compressed columns cannot be memory-mapped) and maps that. Only the text column is
  converted (`columns=[text_field]`), and the cache goes where the caller says (`cache_dir`: the
  prepared folder's own hidden cache, removed when it is finished; a temporary folder for the
  in-memory path), never into the user's global `datasets` cache. A later open with the same
  `cache_dir` finds the conversion done, so worker processes reading rows of one file share it.
- The text field is checked against the schema when the file is opened, before any row is read:
  a missing column or one that is not a string column is a ValueError naming the file; a null in
  a string column is a ValueError naming the file and the row.
- Rows are numbered from 0, as `datasets` indexes them: a document is named `name:row`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["TABLE_SUFFIXES", "import_datasets", "open_table", "table_rows", "table_texts"]

TABLE_SUFFIXES = frozenset({".parquet", ".arrow"})
_BATCH_ROWS = 1024  # rows per slice read from the table: small next to any unit, large for Arrow's overhead


def import_datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "reading Parquet/Arrow files needs the `datasets` package: pip install 'dropless[data]'"
        ) from e
    return datasets


def _missing(path: Path, text_field: str, columns: list[str]) -> ValueError:
    return ValueError(f"{str(path)!r}: no text field {text_field!r} (columns: {columns}); "
                      f"set text_field to the column that holds the text")


def _check_parquet(path: Path, text_field: str) -> int:
    """The row count of a Parquet file whose `text_field` is a string column, from its footer alone."""
    import_datasets()
    import pyarrow as pa
    import pyarrow.parquet as pq  # installed with datasets

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid (not a ValueError) on a file of another format
        raise ValueError(f"{str(path)!r}: cannot read as a Parquet file ({e})") from e
    schema = meta.schema.to_arrow_schema()
    if text_field not in schema.names:
        raise _missing(path, text_field, list(schema.names))
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{str(path)!r}: field {text_field!r} is {kind}, expected a string column")
    return int(meta.num_rows)


def open_table(path: Path, text_field: str, cache_dir: Path | None = None) -> Any:
    """The file as a `datasets.Dataset` of the one column `text_field`, checked to hold strings."""
    datasets = import_datasets()
    if path.suffix == ".parquet":
        _check_parquet(path, text_field)
        ds = datasets.Dataset.from_parquet(str(path), columns=[text_field],
                                           cache_dir=None if cache_dir is None else str(cache_dir))
    elif path.suffix == ".arrow":
        try:
            ds = datasets.Dataset.from_file(str(path))
        except Exception as e:  # pyarrow raises ArrowInvalid (not a ValueError) on a file of another format
            raise ValueError(f"{str(path)!r}: cannot read as an Arrow stream file ({e})") from e
    else:
        raise ValueError(f"{str(path)!r}: not a table file (suffix not in {sorted(TABLE_SUFFIXES)})")
    if text_field not in ds.column_names:
        raise _missing(path, text_field, ds.column_names)
    feature = ds.features[text_field]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ValueError(f"{str(path)!r}: field {text_field!r} is {feature}, expected a string column")
    return ds.select_columns([text_field])


def table_rows(path: Path, text_field: str) -> int:
    """The row count, with the checks of `open_table`, writing nothing: a Parquet file's footer is
    read directly (opening it through `datasets` would convert it first), an Arrow file is mapped."""
    if path.suffix == ".parquet":
        return _check_parquet(path, text_field)
    return len(open_table(path, text_field))


def table_texts(path: Path, name: str, text_field: str, start: int = 0, stop: int | None = None,
                *, cache_dir: Path | None = None) -> Iterator[tuple[str, bytes]]:
    """(name:row, UTF-8 text) of rows [start, stop); empty texts are skipped. (corpus.py makes them
    Documents; this module stays below it.)"""
    ds = open_table(path, text_field, cache_dir)
    stop = len(ds) if stop is None else min(stop, len(ds))
    for lo in range(start, stop, _BATCH_ROWS):
        texts = ds[lo:min(lo + _BATCH_ROWS, stop)][text_field]
        for row, text in enumerate(texts, start=lo):
            if text is None:
                raise ValueError(f"{str(path)!r} row {row}: field {text_field!r} is None, expected str")
            if text:
                yield f"{name}:{row}", text.encode("utf-8", "surrogateescape")
