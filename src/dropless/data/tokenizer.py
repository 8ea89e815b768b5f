"""Tokenizers: a zero-dependency byte tokenizer and a thin wrapper over a local HF `tokenizer.json`.

Design notes
- The byte tokenizer is the default because it needs no download, no file and no vocabulary
  decisions: every string (and every byte sequence, via `encode_bytes`) maps to ids 0..255, so a
  training run on the embedded corpus works offline on any machine. With `vocab_size == 256` the
  data pipeline stores tokens as uint8 (see `data.py`), a quarter of the int32 footprint.
- `decode` uses `errors="replace"`: a model sampling byte ids can emit invalid UTF-8, and decoding
  its output must never raise.
- `HFTokenizer` only ever reads a local file. `tokenizers` is an optional dependency, imported
  lazily in `_import_tokenizers` (the one place) with an error that says what to install.
- Both classes expose the same small surface (`vocab_size`, `encode`, `decode`); nothing else in
  the library may depend on more than that, so a new tokenizer only has to provide these three.
  (`HFTokenizer.encode_batch` is an optional fast path that prepared data uses when present.)
- `tokenizer_identity` is what prepared token files record and check: the kind, the vocabulary size
  and, for a `tokenizer.json`, the sha256 of its bytes. Two files with the same vocabulary but other
  merges, normalisers or added tokens give other ids, so the size alone would not do; the path is
  left out, so a copied tokenizer still matches.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer", "tokenizer_identity", "TOKENIZER_KINDS"]

TOKENIZER_KINDS = ("byte", "hf")


class Tokenizer(Protocol):
    """What the training code needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab_size 256, id == byte value."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        # surrogateescape keeps lone surrogates (e.g. from os.fsdecode) encodable instead of raising.
        return list(text.encode("utf-8", errors="surrogateescape"))

    def encode_bytes(self, data: bytes) -> list[int]:
        """Any byte string, valid UTF-8 or not, as ids."""
        return list(data)

    def decode(self, ids: list[int]) -> str:
        try:
            data = bytes(ids)
        except ValueError as e:
            bad = next(i for i in ids if not 0 <= int(i) < 256)
            raise ValueError(f"ByteTokenizer.decode: id {bad} is outside [0, 256)") from e
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError(
            "HFTokenizer needs the `tokenizers` package: pip install tokenizers "
            "(or pip install 'dropless[hf]')"
        ) from e
    return tokenizers


class HFTokenizer:
    """A local Hugging Face `tokenizer.json` (a file, or a folder containing one); never downloads."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"HFTokenizer: no tokenizer.json at path={str(path)!r}")
        tokenizers = _import_tokenizers()
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise ValueError(
                f"HFTokenizer: cannot parse tokenizer file path={str(p)!r}: {e}"
            ) from e
        self.path = p

    @property
    def vocab_size(self) -> int:
        # with_added_tokens=True: added/special tokens can appear in encoded ids, so the embedding
        # table must cover them.
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS here: documents are joined by the data pipeline, which owns the separator.
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`[encode(t) for t in texts]`, in one call to the Rust side (threads over the batch)."""
        # encode_batch_fast (tokenizers >= 0.21) skips the offsets, which nothing here reads
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def __repr__(self) -> str:
        return f"HFTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(kind: str, path: str | None = None) -> ByteTokenizer | HFTokenizer:
    """Build a tokenizer by kind: "byte" (path ignored) or "hf" (path to tokenizer.json required)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        if not path:
            raise ValueError(
                "load_tokenizer: kind='hf' needs path (a tokenizer.json), got path=None"
            )
        return HFTokenizer(path)
    raise ValueError(f"load_tokenizer: unknown kind={kind!r}; expected one of {TOKENIZER_KINDS}")


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What decides the ids a tokenizer gives: {"kind": "byte", "vocab_size": 256} or
    {"kind": "hf", "vocab_size": n, "sha256": sha256 of the tokenizer.json bytes}."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "byte", "vocab_size": 256}
    if isinstance(tokenizer, HFTokenizer):
        digest = hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()
        return {"kind": "hf", "vocab_size": tokenizer.vocab_size, "sha256": digest}
    raise ValueError(f"tokenizer_identity: unknown tokenizer {tokenizer!r}; expected ByteTokenizer or HFTokenizer")


def train_byte_bpe(texts: Iterable[str], folder: str | Path, vocab_size: int, *, specials: Sequence[str] = (),
                   added: Sequence[str] = ()) -> Path:
    """A byte-level BPE `tokenizer.json` of at most `vocab_size` ids (the `specials` among them), trained
    on `texts`, plus `added` tokens after them; returns its path. For synthetic checkpoints, benchmarks
    and tests (a real run brings its model's tokenizer)."""
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if added:
        tok.add_tokens(list(added))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"
