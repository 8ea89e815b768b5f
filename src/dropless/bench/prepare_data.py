"""`dropless bench prepare-data`: prepare-data's throughput against `datasets.map`, same tokenizer.

    python -m dropless.bench.prepare_data [--mb 50] [--tokenizer hf:PATH] [--files F ...] [--workers 2]

What it runs, on one corpus (the given JSONL/text files, or --mb MB of synthetic JSONL: the Python
standard library's sources, a document per file, repeated with a numbered header until the size
is reached, in 4 files):
- `prepare_data(..., workers=W)` with the HF tokenizer (given, or a byte-level BPE of --vocab tokens
  trained with `tokenizers` on the corpus's first 4 MB), and again with the byte tokenizer;
- the usual `datasets` pipeline: `load_dataset("json")` then `map(batched=True, num_proc=W)` with
  `transformers.PreTrainedTokenizerFast(tokenizer_file=...)` over the same tokenizer.json (its own
  cache folder, so neither run finds the other's work).
It checks that the token streams are identical (each row's ids followed by the separator's are
the prepared shards' ids, in order; val_fraction 0 so every document is in the one split) and
prints MB/s of source bytes for each and the ratio. Both sides include reading and parsing the
JSONL and writing their output (shards; Arrow cache files). CPU flags are printed with the rows:
the tokenizers' speed depends on the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..data.batches import SEPARATOR
from ..data.corpus import stdlib_documents
from ..data.prepare import prepare_data
from ..data.prepared import open_prepared
from ..data.tokenizer import load_tokenizer, train_byte_bpe
from .timing import cpu_flags, format_table


def synthetic_corpus(folder: Path, mb: float, files: int = 4) -> list[Path]:
    docs = stdlib_documents()
    want = int(mb * 2**20)
    paths = [folder / f"corpus-{i}.jsonl" for i in range(files)]
    handles = [open(p, "w", encoding="utf-8") for p in paths]
    written, i = 0, 0
    while written < want:
        d = docs[i % len(docs)]
        line = json.dumps({"text": f"# copy {i // len(docs)} of {d.name}\n" + d.data.decode("utf-8", "replace")})
        handles[i % files].write(line + "\n")
        written += len(line) + 1
        i += 1
    for h in handles:
        h.close()
    return paths


def train_bpe(sources: list[Path], folder: Path, vocab: int) -> Path:
    def texts() -> Any:
        seen = 0
        for p in sources:
            for line in open(p, encoding="utf-8"):
                text = json.loads(line)["text"] if p.suffix == ".jsonl" else line
                yield text
                seen += len(text)
                if seen > 4 << 20:
                    return

    return train_byte_bpe(texts(), folder, vocab)


def datasets_baseline(sources: list[Path], tokenizer_file: Path, workers: int, cache: Path) -> tuple[Any, dict]:
    import datasets
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[str(p) for p in sources], split="train", cache_dir=str(cache))
    t1 = time.perf_counter()
    ids = ds.map(lambda b: {"input_ids": tok(b["text"], add_special_tokens=False)["input_ids"]},
                 batched=True, num_proc=workers, remove_columns=ds.column_names)
    t2 = time.perf_counter()
    return ids, {"load_s": t1 - t0, "map_s": t2 - t1}


def same_stream(prepared: np.ndarray, rows: Any, sep: list[int]) -> bool:
    """The prepared stream equals each row's ids then the separator's, rows in order (empty rows skipped)."""
    column = rows.data.column("input_ids").combine_chunks()
    values = column.values.to_numpy()
    offsets = column.offsets.to_numpy()
    sep_a = np.asarray(sep, dtype=np.int64)
    pos = 0
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        if hi == lo:
            continue
        n = hi - lo
        if not (np.array_equal(prepared[pos:pos + n], values[lo:hi])
                and np.array_equal(prepared[pos + n:pos + n + len(sep_a)], sep_a)):
            return False
        pos += n + len(sep_a)
    return pos == len(prepared)




def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless bench prepare-data", description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=50.0, help="synthetic corpus size (ignored with --files)")
    p.add_argument("--files", nargs="*", default=[], help="JSONL files (field 'text') to use instead")
    p.add_argument("--tokenizer", default="", help="hf:PATH; default: a BPE trained on the corpus")
    p.add_argument("--vocab", type=int, default=16384, help="vocabulary of the trained BPE")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        root = Path(tmp)
        sources = [Path(f) for f in args.files] or synthetic_corpus(root, args.mb)
        size = sum(f.stat().st_size for f in sources)
        if args.tokenizer:
            if not args.tokenizer.startswith("hf:"):
                raise SystemExit("--tokenizer: expected hf:PATH")
            tok_file = Path(args.tokenizer[3:])
            tok_file = tok_file / "tokenizer.json" if tok_file.is_dir() else tok_file
        else:
            tok_file = train_bpe(sources, root, args.vocab)
        rows, mb = [], size / 2**20
        for spec in (f"hf:{tok_file}", "byte"):
            out = root / f"out-{spec.split(':')[0]}"
            t0 = time.perf_counter()
            prepare_data(sources, out, tokenizer=spec, workers=args.workers, val_fraction=0.0, progress=False)
            seconds = time.perf_counter() - t0
            rows.append({"pipeline": f"prepare-data {spec.split(':')[0]}", "seconds": seconds, "MB/s": mb / seconds})
        tokenizer = load_tokenizer("hf", str(tok_file))
        train, _ = open_prepared(root / "out-hf", tokenizer, val_fraction=0.0)
        ours = np.concatenate([np.asarray(r.tokens, dtype=np.int64) for r in train])
        ids, times = datasets_baseline(sources, tok_file, args.workers, root / "hf-cache")
        total = times["load_s"] + times["map_s"]
        rows.append({"pipeline": "datasets load_dataset+map", "seconds": total, "MB/s": mb / total})
        rows.append({"pipeline": "datasets map alone", "seconds": times["map_s"], "MB/s": mb / times["map_s"]})
        same = same_stream(ours, ids, tokenizer.encode(SEPARATOR.decode()))
    print(f"corpus: {mb:.1f} MB in {len(sources)} files; tokenizer {tok_file.name} vocab {tokenizer.vocab_size}; "
          f"workers {args.workers}; {len(ours)} tokens; CPU flags: {cpu_flags()}")
    print(format_table(rows, ["pipeline", "seconds", "MB/s"]))
    print(f"ratio prepare-data hf / datasets load_dataset+map: {rows[0]['MB/s'] / rows[2]['MB/s']:.2f}x; "
          f"/ map alone: {rows[0]['MB/s'] / rows[3]['MB/s']:.2f}x")
    print(f"token streams identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
