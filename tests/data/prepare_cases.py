"""Small corpora and tokenizers for the prepare-data tests, and the in-memory stream to compare with."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dropless.data.batches import SEPARATOR, encode_documents
from dropless.data.corpus import read_documents, split_documents
from dropless.data.tokenizer import train_byte_bpe
from dropless.data.windows import TokenRun

WORDS = ["alpha", "beta", "gamma", "delta", "naïve", "café", "x = f(y)", "\tindent", "ünïcödé", "end."]


def text(i: int, n: int = 40) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n + i % 13)) + f" #{i}"


def write_corpus(root: Path, n_jsonl: int = 120) -> list[Path]:
    """A folder of text files (one hidden, one of another suffix), a JSONL file with blank lines and
    CRLF endings, and a lone text file with no known suffix: what data.sources takes."""
    folder = root / "docs"
    (folder / "sub").mkdir(parents=True)
    for i in range(6):
        (folder / ("sub" if i % 2 else "") / f"f{i}.md").write_text(text(i, 200))
    (folder / ".hidden.md").write_text("never read")
    (folder / "image.bin").write_bytes(b"\x00\x01never read")
    (folder / "empty.txt").write_text("")
    lines = []
    for i in range(n_jsonl):
        lines.append(json.dumps({"text": text(100 + i), "id": i}) + ("\r\n" if i % 5 == 0 else "\n"))
        if i % 17 == 3:
            lines.append("\n")
    (root / "rows.jsonl").write_text("".join(lines), newline="")
    (root / "NOTES").write_bytes("loose file é\n".encode() * 30)
    return [folder, root / "rows.jsonl", root / "NOTES"]


def write_tables(root: Path, n: int = 90) -> list[Path]:
    """The same kind of rows as a Parquet file and as an Arrow file (datasets' own stream format)."""
    import datasets

    ds = datasets.Dataset.from_dict({"text": [text(300 + i) if i % 11 else "" for i in range(n)],
                                     "n": list(range(n))})
    ds.to_parquet(str(root / "rows.parquet"))
    ds.save_to_disk(str(root / "saved"))
    arrow = next((root / "saved").glob("*.arrow"))
    return [root / "rows.parquet", arrow]


def write_bpe(folder: Path, vocab: int = 400) -> Path:
    """A byte-level BPE tokenizer.json trained on the corpus words."""
    return train_byte_bpe([text(i) for i in range(50)], folder, vocab)


def write_wide_vocab(folder: Path, vocab: int = 70_000) -> Path:
    """A word-level tokenizer whose vocabulary does not fit in uint16 (the corpus words sit at the top)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for i in range(400) for w in text(i).split()} | {"\n", "[UNK]"})
    table = {f"w{i}": i for i in range(vocab - len(words))}
    table.update({w: vocab - len(words) + i for i, w in enumerate(words)})
    tok = Tokenizer(models.WordLevel(table, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def expected_splits(sources: list[Path], tokenizer, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The in-memory path's (train, val) streams with the separator after the last document too."""
    sep = np.asarray(tokenizer.encode(SEPARATOR.decode()), dtype=np.int64)
    out = []
    for docs in split_documents(read_documents(sources), val_fraction):
        stream = encode_documents(docs, tokenizer).numpy().astype(np.int64) if docs else np.zeros(0, np.int64)
        out.append(np.concatenate([stream, sep]) if docs else stream)
    return out[0], out[1]


def joined(runs: list[TokenRun]) -> np.ndarray:
    return np.concatenate([np.asarray(r.tokens, dtype=np.int64) for r in runs]) if runs else np.zeros(0, np.int64)

def mapped(array: np.ndarray, run) -> bool:
    """`array` is a read-only view of one of the run's memory maps (nothing copied into the process)."""
    return (not array.flags.writeable and not array.flags.owndata
            and any(memoryview(mm).nbytes == array.nbytes for mm, _ in run.maps))
