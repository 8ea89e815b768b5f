"""One unit of `dropless prepare-data`: its documents, their tokens, its shard files and done-record.

Design notes
- Three stages, each an iterator over the one before, so a new kind of data plugs in at the stage
  it differs: `unit_documents` gives `Document`s (text, JSONL and table pieces, read with
  corpus.py's and tables.py's code); `text_token_docs` gives `(name, ids, loss_mask_or_None)`, the
  ids of a document followed by those of the separator; `UnitWriter` writes those triples. A
  producer of chat data yields its own triples (with a loss mask) to the same writer.
- Byte tokenizer: the bytes are the ids (`np.frombuffer`), no Python ints. HF tokenizer: documents
  go to `encode_batch` in batches of ~1 MiB of text, which the Rust side spreads over threads.
  Text is decoded with errors="replace", as the in-memory path (batches.py) does.
- A unit writes into its own staging folder `DIR/.units/NNNNNN/` shards named `{split}-{j:05d}.*`
  (j counting within the unit); a shard is closed before it would pass `shard_tokens` (at a
  document boundary; a document longer than that is a shard alone). When the unit is done every
  file is fsynced, then the folder, then `DIR/.units/NNNNNN.json` (the done-record: each shard's
  counts, sizes and sha256) is written atomically. Only the record says a unit is finished: a
  staging folder without one is what an interrupted run left, and is deleted and redone.
- The `.loss` file is created only when some document of the shard brings a loss mask; the
  documents before it in that shard get ones (every token a target), as do later ones without.
- sha256 is computed while writing, so the done-record needs no second read of the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from .. import atomic
from .corpus import Document, is_validation, jsonl_documents
from .prepare_plan import Unit
from .prepared import SPLITS, shard_stem
from .tables import table_texts
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["Job", "TokenDoc", "unit_documents", "text_token_docs", "chat_token_docs", "UnitWriter", "run_unit", "unit_record_path",
           "unit_stage_dir", "load_spec"]

TokenDoc = tuple[str, np.ndarray, "np.ndarray | None"]  # (name, ids, loss mask or None)
_BATCH_BYTES = 1 << 20
_WRITE_BUFFER = 1 << 20


class Job(NamedTuple):
    """What every unit of one prepare-data run shares (picklable: sent to worker processes)."""

    out: str
    tokenizer: str  # "byte" or "hf:PATH"
    dtype: str
    val_fraction: float
    text_field: str
    shard_tokens: int
    separator: bytes
    cache_dir: str  # datasets' Arrow copies of Parquet files
    chat_field: str = ""  # chat data: the JSONL field of a conversation (pieces of kind "chat")


def load_spec(spec: str) -> Any:
    """A tokenizer from its command-line spelling: "byte" or "hf:PATH"."""
    if spec == "byte":
        return load_tokenizer("byte")
    if spec.startswith("hf:") and len(spec) > 3:
        return load_tokenizer("hf", spec[3:])
    raise ValueError(f"--tokenizer={spec!r}: expected 'byte' or 'hf:PATH' (a tokenizer.json or its folder)")


def unit_stage_dir(out: Path, index: int) -> Path:
    return out / ".units" / f"{index:06d}"


def unit_record_path(out: Path, index: int) -> Path:
    return out / ".units" / f"{index:06d}.json"


def unit_documents(unit: Unit, text_field: str, cache_dir: Path | None = None) -> Iterator[Document]:
    for p in unit.pieces:
        path = Path(p.path)
        if p.kind == "jsonl":
            yield from jsonl_documents(path, p.name, text_field, p.start, p.stop, p.first_line)
        elif p.kind == "table":
            for name, data in table_texts(path, p.name, text_field, p.start, p.stop, cache_dir=cache_dir):
                yield Document(name, data)
        else:
            data = path.read_bytes()
            if data:
                yield Document(p.name, data)


def _batches(docs: Iterable[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    size = 0
    for d in docs:
        batch.append(d)
        size += len(d.data)
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def text_token_docs(docs: Iterable[Document], tokenizer: Any, separator: bytes, dtype: str) -> Iterator[TokenDoc]:
    """(name, ids of the document then of the separator, None) per document."""
    if isinstance(tokenizer, ByteTokenizer):  # the bytes are the ids
        for d in docs:
            yield d.name, np.frombuffer(d.data + separator, dtype=np.uint8).astype(dtype), None
        return
    sep = tokenizer.encode(separator.decode("utf-8"))
    encode_batch = getattr(tokenizer, "encode_batch", None)
    for batch in _batches(docs):
        texts = [d.data.decode("utf-8", errors="replace") for d in batch]
        ids = encode_batch(texts) if encode_batch else [tokenizer.encode(t) for t in texts]
        for d, doc_ids in zip(batch, ids):
            yield d.name, np.array(doc_ids + sep, dtype=dtype), None


class _Shard:
    """One shard being written: its open files, running sha256s and document starts."""

    def __init__(self, folder: Path, split: str, j: int) -> None:
        self.folder, self.stem = folder, shard_stem(split, j)
        self.split = split
        self.tokens = self._open("tokens")
        self.loss: tuple[IO[bytes], Any] | None = None
        self.starts: list[int] = []
        self.num_tokens = 0

    def _open(self, kind: str) -> tuple[IO[bytes], Any]:
        return open(self.folder / f"{self.stem}.{kind}", "xb", buffering=_WRITE_BUFFER), hashlib.sha256()

    @staticmethod
    def _put(f: tuple[IO[bytes], Any], data: bytes) -> None:
        f[0].write(data)
        f[1].update(data)

    def add(self, ids: np.ndarray, loss: np.ndarray | None) -> None:
        if loss is not None and len(loss) != len(ids):
            raise ValueError(f"loss mask of {len(loss)} values for {len(ids)} tokens")
        if loss is not None and self.loss is None:
            self.loss = self._open("loss")
            self._put(self.loss, bytes([1]) * self.num_tokens)
        if self.loss is not None:
            self._put(self.loss, np.ones(len(ids), np.uint8).tobytes() if loss is None
                      else np.asarray(loss, dtype=np.uint8).tobytes())
        self._put(self.tokens, np.ascontiguousarray(ids).tobytes())
        self.starts.append(self.num_tokens)
        self.num_tokens += len(ids)

    def close(self) -> dict[str, Any]:
        """Write the starts, fsync and close every file; the shard's done-record entry."""
        starts = self._open("starts")
        self._put(starts, np.asarray(self.starts, dtype=np.int64).tobytes())
        files = {}
        for kind, f in (("tokens", self.tokens), ("starts", starts), ("loss", self.loss)):
            if f is None:
                continue
            f[0].flush()
            os.fsync(f[0].fileno())
            files[kind] = {"name": f"{self.stem}.{kind}", "bytes": f[0].tell(), "sha256": f[1].hexdigest()}
            f[0].close()
        return {"split": self.split, "num_tokens": self.num_tokens, "num_documents": len(self.starts),
                "files": files}


class UnitWriter:
    """Writes (name, ids, loss) triples of one unit into shards by split (module note)."""

    def __init__(self, folder: Path, dtype: str, val_fraction: float, shard_tokens: int) -> None:
        self.folder, self.dtype, self.shard_tokens = folder, np.dtype(dtype), shard_tokens
        self.is_val = lambda name: is_validation(name, val_fraction)
        self.open: dict[str, _Shard] = {}
        self.count = {s: 0 for s in SPLITS}
        self.done: list[dict[str, Any]] = []

    def write(self, name: str, ids: np.ndarray, loss: np.ndarray | None = None) -> None:
        if ids.dtype != self.dtype:
            raise ValueError(f"document {name!r}: ids are {ids.dtype}, the folder stores {self.dtype}")
        if len(ids) == 0:
            return
        split = "val" if self.is_val(name) else "train"
        shard = self.open.get(split)
        if shard is not None and shard.num_tokens + len(ids) > self.shard_tokens:
            self.done.append(shard.close())
            shard = None
        if shard is None:
            shard = self.open[split] = _Shard(self.folder, split, self.count[split])
            self.count[split] += 1
        shard.add(ids, loss)

    def close(self) -> list[dict[str, Any]]:
        for shard in self.open.values():
            self.done.append(shard.close())
        self.open = {}
        return sorted(self.done, key=lambda s: (s["split"], s["files"]["tokens"]["name"]))


def chat_token_docs(unit: Unit, job: Job) -> Iterator[TokenDoc]:
    """(name, ids, assistant mask) per conversation of the unit's chat pieces (data/chat.py), rendered
    whole: a conversation longer than the run's window is found when a run opens the folder."""
    from .chat import ChatTemplate, read_chat

    template = ChatTemplate(job.tokenizer[len("hf:"):])
    for p in unit.pieces:
        for e in read_chat(p.path, template, field=job.chat_field, start=p.start, stop=p.stop,
                           first_line=p.first_line):
            yield e.name, e.ids.astype(job.dtype), e.loss


def run_unit(unit: Unit, job: Job) -> dict[str, Any]:
    """Tokenise `unit` into its staging folder and write its done-record; returns the record."""
    out = Path(job.out)
    stage = unit_stage_dir(out, unit.index)
    if stage.exists():  # an interrupted earlier attempt: no record claims it
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    tokenizer = load_spec(job.tokenizer)
    writer = UnitWriter(stage, job.dtype, job.val_fraction, job.shard_tokens)
    if job.chat_field:
        for name, ids, loss in chat_token_docs(unit, job):
            writer.write(name, ids, loss)
    else:
        docs = unit_documents(unit, job.text_field, Path(job.cache_dir))
        for name, ids, loss in text_token_docs(docs, tokenizer, job.separator, job.dtype):
            writer.write(name, ids, loss)
    record = {"unit": unit.index, "source_bytes": unit.nbytes, "shards": writer.close()}
    atomic.fsync_dir(stage)
    atomic.write_text(unit_record_path(out, unit.index), json.dumps(record), fsync=True)
    return record
