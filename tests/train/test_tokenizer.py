"""Tokenizers: byte round trips (including bytes that are not UTF-8), the HF wrapper, the factory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dropless.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_round_trip_text() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # naïve, 日本語, emoji 🙂"
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert all(0 <= i < 256 for i in ids)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_non_utf8_bytes() -> None:
    # Every byte value, including lone continuation bytes and 0xFF, which are never valid UTF-8:
    # ids round-trip exactly, and decode replaces instead of raising.
    tok = ByteTokenizer()
    data = bytes(range(256)) + b"\xff\xfe\xc3"
    ids = tok.encode_bytes(data)
    assert bytes(ids) == data
    text = tok.decode(ids)
    assert "\ufffd" in text
    assert text.startswith(bytes(range(128)).decode("ascii"))


def test_byte_decode_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match="300"):
        ByteTokenizer().decode([65, 300])


def _write_hf_tokenizer(path: Path) -> Path:
    # tokenizers is a dev dependency (pyproject.toml), installed by `make test`: a missing install
    # fails here instead of skipping the HF tests silently
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"])
    tok.train_from_iterator(["hello world", "hello there", "world of words"] * 10, trainer)
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def test_hf_tokenizer_local_file(tmp_path: Path) -> None:
    file = _write_hf_tokenizer(tmp_path)
    for p in (file, tmp_path):  # the file itself, or the folder holding it
        tok = HFTokenizer(p)
        ids = tok.encode("hello world")
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids).replace(" ", "") == "helloworld"
    assert isinstance(load_tokenizer("hf", str(file)), HFTokenizer)


def test_hf_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        HFTokenizer(tmp_path / "nope.json")


def test_hf_import_error_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        HFTokenizer(tmp_path)


def test_load_tokenizer_errors() -> None:
    assert isinstance(load_tokenizer("byte", None), ByteTokenizer)
    with pytest.raises(ValueError, match="'bpe'"):
        load_tokenizer("bpe", None)
    with pytest.raises(ValueError, match="path"):
        load_tokenizer("hf", None)


def test_hf_malformed_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot parse"):
        HFTokenizer(tmp_path)


def test_hf_tokenizer_through_data_pipeline(tmp_path: Path) -> None:
    from dropless.data.batches import get_batch, load_splits, token_dtype

    tok = HFTokenizer(_write_hf_tokenizer(tmp_path))
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(30):
        (docs / f"{i}.txt").write_text("hello world of words " * 5)
    train, val = load_splits([docs], tok, val_fraction=0.2)
    assert train.dtype == token_dtype(tok.vocab_size)  # 60 ids fit in uint8; >256 would be int32
    assert val.numel() > 0
    x, y = get_batch(train, 0, 0, 2, 8, seed=0)
    assert x.dtype == torch.int64 and int(x.max()) < tok.vocab_size
