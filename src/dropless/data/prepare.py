"""`dropless prepare-data`: tokenise a corpus once, offline, into memory-mappable shards.

    dropless prepare-data SOURCES... --out DIR [--tokenizer byte|hf:PATH] [--workers N]
        [--val-fraction 0.05] [--text-field text] [--chat-field messages] [--shard-tokens N]

Sources are what `data.sources` takes (corpus.read_documents: files, folders, JSONL) plus Parquet
and Arrow files; the folder format is in prepared.py, which also reads it.

Design notes
- Order of a run: load the tokenizer, list the sources and plan the units (prepare_plan.py), all
  before anything is written, so a missing file, a tokenizer that does not load or a Parquet file
  without the text column is refused with DIR untouched. Then DIR must be empty, or hold an
  unfinished run of the same settings (resumed), or a finished one (same settings: nothing to do;
  other settings: refused, naming each difference). `DIR/.units/plan.json` records the settings
  of an unfinished run.
- Units run in `--workers` processes, each tokenising on one thread (TOKENIZERS_PARALLELISM=false,
  unless set): one core per worker. They are forked on Linux: a spawned worker would first import
  the package (torch with it, ~2 s a process), which at 2 workers made 50 MB of byte-tokenised
  JSONL take 5.1 s instead of 0.5 s forked (0.4 s in-process). The forking process has loaded
  the tokenizer but not run it, and a worker never runs torch, so no thread pool is copied
  mid-use. Elsewhere
  (macOS, Windows, where fork is unsafe or absent) they are spawned.
- Resume: a unit's done-record (prepare_units.py) is written after its files are durable; a run
  started again skips units with a record and redoes the others from scratch.
- Finishing: when every unit has its record, the staged shard files are renamed (never copied or
  rewritten) into `DIR/{split}-{k:05d}.*`, k counting each split's shards in unit order; the rename
  plan is a function of the records alone, so a finish interrupted halfway completes on the next
  run. Then the manifest is written, atomically and last, and `.units` and the Parquet cache go.
- The shards are a function of the sources and settings, not of the number of workers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from .. import atomic
from .batches import SEPARATOR
from .corpus import SourceFile, source_files
from .prepare_plan import DEFAULT_UNIT_BYTES, Unit, plan_units
from .prepare_units import Job, load_spec, run_unit, unit_record_path, unit_stage_dir
from .prepared import FORMAT, MANIFEST, SPLITS, VERSION, read_manifest, shard_stem, token_dtype
from .tables import open_table
from .tokenizer import tokenizer_identity

__all__ = ["prepare_data", "main", "DEFAULT_SHARD_TOKENS"]

DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 ids; a unit (~16 MiB of text) rarely reaches it
_COMPARED = ("format", "version", "tokenizer", "dtype", "val_fraction", "text_field", "separator",
             "shard_tokens", "unit_bytes", "sources", "chat_field", "chat_template")


def _sources(sources: Sequence[str | Path], files: list[SourceFile]) -> list[dict[str, Any]]:
    out = [{"path": str(Path(s).expanduser().resolve()), "bytes": 0, "files": 0} for s in sources]
    for f in files:
        out[f.source]["bytes"] += f.path.stat().st_size
        out[f.source]["files"] += 1
    return out


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    diffs = []
    for key in _COMPARED:
        if key == "sources" and [s["path"] for s in old["sources"]] == [s["path"] for s in new["sources"]]:
            diffs += [f"source {n['path']!r} was {o['bytes']} bytes in {o['files']} files, now {n['bytes']} "
                      f"bytes in {n['files']} files" for o, n in zip(old["sources"], new["sources"]) if o != n]
        elif old.get(key) != new.get(key):
            diffs.append(f"{key}: {old.get(key)!r} there, {new.get(key)!r} now")
    if not diffs and old.get("units_sha256", new["units_sha256"]) != new["units_sha256"]:
        diffs.append("the sources' files changed (same sizes, other files or order)")
    return diffs


def _refuse(out: Path, what: str, diffs: list[str]) -> ValueError:
    return ValueError(f"--out={str(out)!r} holds {what} prepared with other settings: {'; '.join(diffs)}; "
                      f"choose another --out, or delete it to prepare again")


class _Progress:
    """Source bytes done, on stderr: tqdm when installed, a line every few seconds otherwise."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.bar, self.last = total, initial, enabled, None, 0.0
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, initial=initial, desc="prepare-data", unit="B", unit_scale=True,
                            file=sys.stderr)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and (time.monotonic() - self.last > 5 or self.done == self.total):
            self.last = time.monotonic()
            print(f"prepare-data: {self.done / 2**20:.1f} / {self.total / 2**20:.1f} MiB", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _one_thread() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _run_units(todo: list[Unit], job: Job, workers: int, bar: _Progress) -> None:
    if workers == 1 or len(todo) <= 1:
        for unit in todo:
            run_unit(unit, job)
            bar.update(unit.nbytes)
        return
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ctx.Pool(min(workers, len(todo)), initializer=_one_thread) as pool:
        sizes = {u.index: u.nbytes for u in todo}
        for record in pool.imap_unordered(partial(run_unit, job=job), todo):
            bar.update(sizes[record["unit"]])


def _finish(out: Path, units: list[Unit], settings: dict[str, Any]) -> dict[str, Any]:
    records = [json.loads(unit_record_path(out, u.index).read_text()) for u in units]
    totals = {s: {"tokens": 0, "documents": 0, "shards": 0} for s in SPLITS}
    for rec in records:
        for sh in rec["shards"]:
            t = totals[sh["split"]]
            t["tokens"] += sh["num_tokens"]
            t["documents"] += sh["num_documents"]
    if not any(t["tokens"] for t in totals.values()):
        raise ValueError(f"no text found in {[s['path'] for s in settings['sources']]}: every document is empty")
    shards = []
    for unit, rec in zip(units, records):
        stage = unit_stage_dir(out, unit.index)
        for sh in rec["shards"]:
            stem = shard_stem(sh["split"], totals[sh["split"]]["shards"])
            totals[sh["split"]]["shards"] += 1
            files = {}
            for kind, entry in sh["files"].items():
                src, dst = stage / entry["name"], out / f"{stem}.{kind}"
                if src.exists():
                    os.replace(src, dst)
                elif not (dst.is_file() and dst.stat().st_size == entry["bytes"]):
                    raise ValueError(f"--out={str(out)!r}: staged file {str(src)!r} is missing and "
                                     f"{dst.name!r} is not in place; delete the folder and prepare again")
                files[kind] = {**entry, "name": dst.name}
            shards.append({"split": sh["split"], "num_tokens": sh["num_tokens"],
                           "num_documents": sh["num_documents"], "files": files})
    atomic.fsync_dir(out)
    manifest = {**settings, "shards": shards, "totals": totals}
    atomic.write_text(out / MANIFEST, json.dumps(manifest, indent=1) + "\n", fsync=True)
    shutil.rmtree(out / ".units", ignore_errors=True)
    shutil.rmtree(out / ".cache", ignore_errors=True)
    return manifest


def _chat_settings(files: list[SourceFile], tokenizer: str, chat_field: str) -> dict[str, Any]:
    """{"chat_field", "chat_template"} when the sources are chat JSONL (data/chat.py), {} for text;
    refuses a mix, and chat data without an HF tokenizer that has a chat template."""
    from .chat import is_chat_jsonl

    chat = {str(f.path): f.path.suffix == ".jsonl" and is_chat_jsonl(f.path, chat_field) for f in files}
    if not any(chat.values()):
        return {}
    if not all(chat.values()):
        text = [p for p, c in chat.items() if not c][:3]
        raise ValueError(f"the sources mix chat JSONL (lines with {chat_field!r}) with text ({text}); "
                         "prepare one kind per folder")
    if not tokenizer.startswith("hf:"):
        raise ValueError(f"--tokenizer={tokenizer!r}: chat data is rendered with an HF tokenizer's chat "
                         "template (--tokenizer hf:PATH, the run's tokenizer)")
    from .chat import ChatTemplate

    return {"chat_field": chat_field, "chat_template": ChatTemplate(tokenizer[len("hf:"):]).identity}


def prepare_data(sources: Sequence[str | Path], out: str | Path, *, tokenizer: str = "byte", workers: int = 1,
                 val_fraction: float = 0.05, text_field: str = "text",
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, unit_bytes: int = DEFAULT_UNIT_BYTES,
                 progress: bool = True, chat_field: str = "messages") -> dict[str, Any]:
    """Tokenise `sources` into the prepared folder `out` (prepared.py), resuming an unfinished one;
    returns its manifest. `tokenizer` is "byte" or "hf:PATH". Chat JSONL (lines holding
    `chat_field`) is rendered with the tokenizer's chat template, with its assistant-token masks."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers={workers!r}: must be an int >= 1")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction={val_fraction!r}: must be in [0, 1)")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"--shard-tokens={shard_tokens!r}: must be an int >= 1")
    tok = load_spec(tokenizer)
    identity = tokenizer_identity(tok)
    files = source_files(sources)
    out = Path(out)
    settings: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "tokenizer": identity, "dtype": token_dtype(identity["vocab_size"]),
        "val_fraction": val_fraction, "text_field": text_field, "separator": SEPARATOR.decode("utf-8"),
        "shard_tokens": shard_tokens, "unit_bytes": unit_bytes, "sources": _sources(sources, files),
        **_chat_settings(files, tokenizer, chat_field)}
    if (out / MANIFEST).is_file():
        old = read_manifest(out)
        diffs = _differences(old, {**settings, "units_sha256": old.get("units_sha256")})
        if diffs:
            raise _refuse(out, "data", diffs)
        print(f"{str(out)!r} is already prepared with these settings; nothing to do", file=sys.stderr)
        return old
    units = plan_units(files, text_field, unit_bytes)
    if "chat_field" in settings:  # cut like any JSONL, rendered as conversations
        units = [u._replace(pieces=tuple(p._replace(kind="chat") for p in u.pieces)) for u in units]
    if not units:
        raise ValueError(f"no text found in {[str(s) for s in sources]} (folders are searched for the "
                         f"suffixes of corpus.TEXT_SUFFIXES; every file found is empty)")
    # paths left out: the same files named from another working folder plan the same units
    pieces = [(p.name, p.kind, p.start, p.stop, p.first_line, p.nbytes) for u in units for p in u.pieces]
    settings["units_sha256"] = hashlib.sha256(json.dumps([len(units), pieces]).encode()).hexdigest()
    plan = out / ".units" / "plan.json"
    if plan.is_file():
        diffs = _differences(json.loads(plan.read_text()), settings)
        if diffs:
            raise _refuse(out, "an unfinished run", diffs)
    else:
        atomic.require_empty_dir(out)
        plan.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(plan, json.dumps(settings, indent=1), fsync=True)
    todo = [u for u in units if not unit_record_path(out, u.index).is_file()]
    cache = out / ".cache"
    for path in dict.fromkeys(p.path for u in todo for p in u.pieces if p.path.endswith(".parquet")):
        open_table(Path(path), text_field, cache)  # converted once here; workers map the copy
    job = Job(str(out), tokenizer, settings["dtype"], val_fraction, text_field, shard_tokens, SEPARATOR, str(cache),
              settings.get("chat_field", ""))
    bar = _Progress(sum(u.nbytes for u in units), sum(u.nbytes for u in units) - sum(u.nbytes for u in todo),
                    progress)
    try:
        _run_units(todo, job, workers, bar)
    finally:
        bar.close()
    return _finish(out, units, settings)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless prepare-data", description=__doc__.split("\n")[0])
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="text files, folders, .jsonl, .parquet or .arrow files")
    p.add_argument("--out", required=True, metavar="DIR", help="the prepared folder to write (or resume)")
    p.add_argument("--tokenizer", default="byte", help="byte, or hf:PATH (a tokenizer.json or its folder)")
    p.add_argument("--workers", type=int, default=1, help="processes tokenising units in parallel")
    p.add_argument("--val-fraction", type=float, default=0.05, help="documents held out (by name hash)")
    p.add_argument("--text-field", default="text", help="the JSONL key / table column holding the text")
    p.add_argument("--chat-field", default="messages",
                   help="the JSONL key holding a conversation: such files are chat data (loss on replies)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="most tokens in a shard")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        manifest = prepare_data(args.sources, args.out, tokenizer=args.tokenizer, workers=args.workers,
                                val_fraction=args.val_fraction, text_field=args.text_field,
                                shard_tokens=args.shard_tokens, progress=not args.no_progress,
                                chat_field=args.chat_field)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"dropless prepare-data: error: {err}", file=sys.stderr)
        return 2
    for split, t in manifest["totals"].items():
        print(f"{split}: {t['tokens']} tokens, {t['documents']} documents, {t['shards']} shards")
    print(f"prepared {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
