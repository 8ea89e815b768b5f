"""Prepared token folders (what `dropless prepare-data` writes): the format and its reader.

Layout of a folder DIR:
    DIR/manifest.json                 written last, atomically: a folder without it is unfinished
    DIR/{split}-{k:05d}.tokens        ids, raw little-endian uint16 (vocab_size <= 65536) or uint32
    DIR/{split}-{k:05d}.starts        int64 offset of each document's first token in the shard
                                      (sorted, starts[0] == 0)
    DIR/{split}-{k:05d}.loss          optional: uint8 per token, 1 = the token may be a loss target
split is "train" or "val"; k counts each split's shards from 0. Every document's tokens end with
the tokens of the separator (batches.SEPARATOR for text), so a shard is the in-memory token stream
of its documents with one separator after the last as well.

manifest.json:
    {"format": "dropless-prepared", "version": 1,
     "tokenizer": tokenizer_identity(...), "dtype": "uint16" | "uint32",
     "val_fraction": f, "text_field": "text", "separator": "\\n\\n",
     "shard_tokens": n, "unit_bytes": n,
     "sources": [{"path": absolute path, "bytes": n, "files": n}, ...],
     "shards": [{"split": "train", "num_tokens": n, "num_documents": n,
                 "files": {"tokens": {"name": "train-00000.tokens", "bytes": n, "sha256": hex},
                           "starts": {...}, "loss": {...} (present only when written)}}, ...],
     "totals": {"train": {"tokens": n, "documents": n, "shards": n}, "val": {...}}}

The reader (`open_prepared`) checks before it returns, each failure a ValueError naming the folder
(and the shard): the manifest is there and finished; the tokenizer's identity and the val fraction
are the ones the folder was prepared with (the split is decided when preparing, so another fraction
means preparing again); every file has its size and (with verify) its sha256. The sha256 pass reads
the files with plain buffered reads into one reused buffer, not through the memory maps: a page
read through a map counts in the process's RSS until the kernel reclaims it, and checking a folder
must not make RSS grow with the corpus. Then the token and loss files are opened as read-only
memory maps; only the starts arrays (8 bytes a document) are read into memory.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .tokenizer import tokenizer_identity
from .windows import TokenRun

__all__ = ["TokenRun", "open_prepared", "read_manifest", "token_dtype", "shard_stem", "file_sha256",
           "FORMAT", "VERSION", "MANIFEST", "SPLITS", "FILE_KINDS"]

FORMAT = "dropless-prepared"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
FILE_KINDS = {"tokens": None, "starts": np.int64, "loss": np.uint8}  # None: the manifest's dtype
_READ_CHUNK = 8 << 20
_BAR_BYTES = 256 << 20  # verification shows a progress bar above this many bytes


def token_dtype(vocab_size: int) -> str:
    """The stored id dtype: uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size <= 0 or vocab_size > 2**32:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, 2**32] for prepared token files")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def shard_stem(split: str, k: int) -> str:
    return f"{split}-{k:05d}"


def file_sha256(path: Path, buffer: bytearray | None = None) -> str:
    """sha256 of a file by buffered reads into one reused buffer (never a memory map)."""
    buffer = bytearray(_READ_CHUNK) if buffer is None else buffer
    view = memoryview(buffer)
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise ValueError(f"prepared data {str(folder)!r}: no {MANIFEST}: not a prepared folder, or "
                         f"`dropless prepare-data` has not finished (run it again to resume)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"prepared data {str(folder)!r}: cannot read {MANIFEST}: {e}") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"prepared data {str(folder)!r}: {MANIFEST} is format "
                         f"{manifest.get('format')!r} version {manifest.get('version')!r}; this reader "
                         f"reads {FORMAT!r} version {VERSION}: prepare the data again")
    return manifest


def _check_settings(folder: Path, manifest: dict[str, Any], tokenizer: Any, val_fraction: float) -> None:
    want = tokenizer_identity(tokenizer)
    if manifest["tokenizer"] != want:
        raise ValueError(f"prepared data {str(folder)!r} was prepared with another tokenizer: "
                         f"{manifest['tokenizer']}, and this run's is {want}; prepare the data again "
                         f"with this tokenizer (or use the one it was prepared with)")
    if float(manifest["val_fraction"]) != float(val_fraction):
        raise ValueError(f"prepared data {str(folder)!r} was split with val_fraction="
                         f"{manifest['val_fraction']}, and this run asks val_fraction={val_fraction}: set "
                         f"data.val_fraction={manifest['val_fraction']} or prepare the data again")


def _check_files(folder: Path, manifest: dict[str, Any], verify: bool) -> None:
    dtype = np.dtype(manifest["dtype"])
    entries = []
    for shard in manifest["shards"]:
        for kind, entry in shard["files"].items():
            itemsize = (dtype if FILE_KINDS[kind] is None else np.dtype(FILE_KINDS[kind])).itemsize
            count = shard["num_documents"] if kind == "starts" else shard["num_tokens"]
            path = folder / entry["name"]
            size = path.stat().st_size if path.is_file() else None
            if size is None or size != entry["bytes"] or size != count * itemsize:
                found = "missing" if size is None else f"{size} bytes"
                raise ValueError(f"prepared data {str(folder)!r}: corrupt or incomplete shard "
                                 f"{entry['name']!r}: {found}, expected {count * itemsize} bytes; "
                                 f"prepare the data again")
            entries.append((path, entry))
    if not verify:
        return
    total = sum(e["bytes"] for _, e in entries)
    bar = _bar(total) if total >= _BAR_BYTES else None
    buffer = bytearray(_READ_CHUNK)
    for path, entry in entries:
        if file_sha256(path, buffer) != entry["sha256"]:
            raise ValueError(f"prepared data {str(folder)!r}: corrupt or incomplete shard "
                             f"{entry['name']!r}: its sha256 differs from the manifest's; prepare the "
                             f"data again")
        if bar is not None:
            bar.update(entry["bytes"])
    if bar is not None:
        bar.close()


def _bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="verify prepared data", unit="B", unit_scale=True, file=sys.stderr)


def _map(path: Path, dtype: np.dtype) -> tuple[np.ndarray, tuple[mmap.mmap, int] | None]:
    """A read-only memory map of `path` as an array, and (the map, the item size) for TokenRun.release.
    MADV_RANDOM: a window reads the pages it needs, not the kernel's read-ahead around them, which
    would map up to hundreds of KB per window into the resident set."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype), None
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mm, dtype=dtype), (mm, np.dtype(dtype).itemsize)


def _open_run(folder: Path, shard: dict[str, Any], dtype: np.dtype) -> TokenRun:
    files = shard["files"]
    tokens, token_map = _map(folder / files["tokens"]["name"], dtype)
    starts = np.fromfile(folder / files["starts"]["name"], dtype=np.int64)
    loss, loss_map = _map(folder / files["loss"]["name"], np.uint8) if "loss" in files else (None, None)
    if starts.size == 0 or starts[0] != 0 or np.any(np.diff(starts) < 0) or starts[-1] >= tokens.size:
        raise ValueError(f"prepared data {str(folder)!r}: corrupt shard {files['starts']['name']!r}: "
                         f"document starts are not sorted from 0 within the shard's "
                         f"{tokens.size} tokens; prepare the data again")
    return TokenRun(tokens, starts, loss, tuple(m for m in (token_map, loss_map) if m is not None))


def open_prepared(folder: str | Path, tokenizer: Any, *, val_fraction: float, verify: bool = True,
                  chat_template: dict[str, Any] | None = None) -> tuple[list[TokenRun], list[TokenRun]]:
    """(train runs, val runs): memory-mapped, checked before returning. `chat_template`: the run's
    template identity (data/chat.py), which a folder of chat data must have been rendered with."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    _check_settings(folder, manifest, tokenizer, val_fraction)
    if "chat_template" in manifest and manifest["chat_template"] != chat_template:
        raise ValueError(f"prepared data {str(folder)!r} holds conversations rendered with another chat "
                         f"template ({manifest['chat_template']}) than the run's tokenizer has "
                         f"({chat_template or 'none'}); prepare it again with the run's tokenizer")
    _check_files(folder, manifest, verify)
    dtype = np.dtype(manifest["dtype"])
    runs: dict[str, list[TokenRun]] = {s: [] for s in SPLITS}
    for shard in manifest["shards"]:
        runs[shard["split"]].append(_open_run(folder, shard, dtype))
    return runs["train"], runs["val"]
