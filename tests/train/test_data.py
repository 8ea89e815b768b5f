"""Corpora, splits, token encoding and the stateless batch sampler.

The stdlib corpus is always capped with max_bytes here (the full corpus is ~12 MB) so the file
stays well under a second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dropless.data.corpus import (
    Document,
    STDLIB_EXCLUDED_DIRS,
    read_documents,
    split_documents,
    stdlib_documents,
    stdlib_files,
    stdlib_root,
)
from dropless.data.batches import (
    SEPARATOR,
    encode_documents,
    encode_documents_reference,
    eval_batches,
    get_batch,
    load_splits,
    token_dtype,
)
from dropless.data.tokenizer import ByteTokenizer

CAP = 300_000


# ---------------------------------------------------------------- stdlib corpus


def test_stdlib_files_exclude_tests_and_site_packages() -> None:
    root = stdlib_root()
    files = stdlib_files()
    assert len(files) > 100
    assert files == sorted(files)
    for f in files:
        rel = f.relative_to(root)
        assert f.suffix == ".py"
        assert not set(rel.parts[:-1]) & STDLIB_EXCLUDED_DIRS, rel
    names = {f.relative_to(root).as_posix() for f in files}
    assert "os.py" in names
    assert not any(n.startswith(("idlelib/idle_test/", "lib2to3/tests/", "test/")) for n in names)


def test_stdlib_documents_capped_and_deterministic() -> None:
    docs = stdlib_documents(max_bytes=CAP)
    assert sum(len(d.data) for d in docs) == CAP
    assert len(docs) > 3  # a sample across the library, not one huge file
    assert docs == stdlib_documents(max_bytes=CAP)
    assert [d.name for d in docs] == sorted(d.name for d in docs)


def test_split_deterministic_and_disjoint() -> None:
    docs = stdlib_documents(max_bytes=2_000_000)
    train, val = split_documents(docs, 0.2)
    train2, val2 = split_documents(docs, 0.2)
    assert train == train2 and val == val2
    names_t, names_v = {d.name for d in train}, {d.name for d in val}
    assert names_t.isdisjoint(names_v)
    assert names_t | names_v == {d.name for d in docs}
    assert 0.05 < len(val) / len(docs) < 0.4
    # A document's split does not depend on which other documents are present.
    _, val_sub = split_documents(docs[::2], 0.2)
    assert {d.name for d in val_sub} == names_v & {d.name for d in docs[::2]}


def test_split_uses_no_salted_hash(tmp_path: Path) -> None:
    # A fresh interpreter (new PYTHONHASHSEED) must compute the same split.
    code = (
        "from dropless.data.corpus import is_validation;"
        "print(''.join('1' if is_validation(f'doc{i}', 0.3) else '0' for i in range(64)))"
    )
    import subprocess

    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True, text=True, check=True,
            env={"PYTHONPATH": str(Path(__file__).parents[2] / "src"), "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


def test_load_splits_stdlib_uint8() -> None:
    train, val = load_splits(None, ByteTokenizer(), max_bytes=CAP)
    assert train.dtype == torch.uint8 and val.dtype == torch.uint8
    assert train.dim() == 1 and train.numel() > 0 and val.numel() > 0


# ---------------------------------------------------------------- user sources


def test_user_files_folders_jsonl(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha")
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.md").write_text("beta")
    (folder / "sub" / "c.py").write_text("gamma = 1")
    (folder / "image.png").write_bytes(b"\x89PNG")  # not a text suffix: skipped
    (folder / ".hidden.txt").write_text("secret")  # hidden: skipped
    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps({"content": "delta"}) + "\n\n" + json.dumps({"content": "eps"}) + "\n")

    docs = read_documents([tmp_path / "a.txt", folder, jl], text_field="content")
    assert [d.name for d in docs] == ["a.txt", "corpus/b.md", "corpus/sub/c.py", "d.jsonl:1", "d.jsonl:3"]
    assert [d.data for d in docs] == [b"alpha", b"beta", b"gamma = 1", b"delta", b"eps"]

    train, val = load_splits([tmp_path / "a.txt", folder], ByteTokenizer(), val_fraction=0.5)
    assert train.numel() + val.numel() > 0


def test_single_file_falls_back_to_token_split(tmp_path: Path) -> None:
    f = tmp_path / "book.txt"
    f.write_bytes(bytes(range(200)) * 10)
    train, val = load_splits([f], ByteTokenizer(), val_fraction=0.1)
    assert val.numel() == 200 and train.numel() == 1800
    assert torch.equal(torch.cat([train, val]), torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8))


def test_user_max_bytes(tmp_path: Path) -> None:
    for i in range(20):
        (tmp_path / f"{i:02d}.txt").write_text("x" * 100)
    docs = read_documents([tmp_path], max_bytes=450)
    assert sum(len(d.data) for d in docs) == 450
    assert [d.name for d in docs] == sorted(d.name for d in docs)


def test_error_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        read_documents([tmp_path / "missing.txt"])


def test_error_empty_corpus(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "data.bin").write_bytes(b"\x00")
    with pytest.raises(ValueError, match="no text found in"):
        read_documents([tmp_path])
    with pytest.raises(ValueError, match="sources is empty"):
        read_documents([])


def test_error_jsonl_missing_field(tmp_path: Path) -> None:
    jl = tmp_path / "bad.jsonl"
    jl.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl.*line 2.*'text'"):
        read_documents([jl])
    jl.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl.*line 2.*invalid JSON"):
        read_documents([jl])
    jl.write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match=r"line 1.*'text'.*int"):
        read_documents([jl])


def test_error_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # chmod 0 does not stop root (CI containers), so simulate the OSError a read would raise.
    f = tmp_path / "locked.txt"
    f.write_text("x")

    def deny(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", deny)
    with pytest.raises(ValueError, match="locked.txt.*Permission denied"):
        read_documents([f])


@pytest.mark.parametrize("bad", [{"val_fraction": 1.0}, {"max_bytes": 0}])
def test_bad_arguments(bad: dict) -> None:
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        load_splits(None, ByteTokenizer(), **{"max_bytes": 1000, **bad})


# ---------------------------------------------------------------- encoding


class _ListByteTokenizer:
    """Byte semantics through the generic path, to compare with the frombuffer fast path."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_fast_path_matches_reference() -> None:
    docs = stdlib_documents(max_bytes=50_000)  # stdlib sources are UTF-8
    fast = encode_documents(docs, ByteTokenizer())
    ref = encode_documents_reference(docs, _ListByteTokenizer())
    assert fast.dtype == ref.dtype == torch.uint8
    assert torch.equal(fast, ref)
    assert bytes(fast[: len(docs[0].data) + 2].tolist()) == docs[0].data + SEPARATOR


def test_fast_path_keeps_non_utf8_and_empty() -> None:
    docs = [Document("a", b"\xff\xfe"), Document("b", b"ok")]
    assert bytes(encode_documents(docs, ByteTokenizer()).tolist()) == b"\xff\xfe\n\nok"
    assert encode_documents([], ByteTokenizer()).numel() == 0


def test_token_dtype() -> None:
    assert token_dtype(256) == torch.uint8
    assert token_dtype(257) == torch.int32
    assert token_dtype(200_000) == torch.int32
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)


# ---------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.arange(5000, dtype=torch.int32)  # token value == position: windows are checkable


def test_get_batch_shape_shift_and_determinism(tokens: torch.Tensor) -> None:
    x, y = get_batch(tokens, step=7, micro_step=1, batch_size=4, seq_len=32, seed=0)
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 31, dtype=torch.int64))  # contiguous windows
    assert torch.equal(y[:, -1], x[:, -1] + 1)
    # Resuming at step 7 reproduces the batch, whatever was drawn before.
    get_batch(tokens, 3, 0, 4, 32, 0)
    x2, y2 = get_batch(tokens, 7, 1, 4, 32, 0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    # Different step, micro-step, seed or rank: different draws.
    for args, kw in [((8, 1, 4, 32, 0), {}), ((7, 0, 4, 32, 0), {}), ((7, 1, 4, 32, 1), {}), ((7, 1, 4, 32, 0), {"rank": 1})]:
        assert not torch.equal(get_batch(tokens, *args, **kw)[0], x)


def test_get_batch_covers_range_and_uint8() -> None:
    tokens = torch.arange(11, dtype=torch.uint8)
    seen = set()
    for step in range(200):
        x, y = get_batch(tokens, step, 0, 2, 10, seed=0)  # only one valid start: 0
        seen.update(x[:, 0].tolist())
        assert y.max().item() == 10
    assert seen == {0}
    with pytest.raises(ValueError, match="seq_len"):
        get_batch(tokens, 0, 0, 2, 11, seed=0)


def test_eval_batches(tokens: torch.Tensor) -> None:
    batches = list(eval_batches(tokens, batch_size=8, seq_len=100))
    n_windows = (5000 - 1) // 100
    assert sum(x.shape[0] for x, _ in batches) == n_windows
    assert all(x.shape[0] == 8 for x, _ in batches[:-1])
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert torch.equal(starts, torch.arange(n_windows) * 100)  # fixed, non-overlapping, in order
    assert all(torch.equal(y[:, :-1], x[:, 1:]) for x, y in batches)
    # max_batches spreads the windows across the split, and is deterministic.
    few = list(eval_batches(tokens, 4, 100, max_batches=2))
    assert len(few) == 2 and all(x.shape == (4, 100) for x, _ in few)
    few_starts = torch.cat([x[:, 0] for x, _ in few])
    assert few_starts[-1] > 2500 and len(set(few_starts.tolist())) == 8
    assert all(torch.equal(a[0], b[0]) for a, b in zip(few, eval_batches(tokens, 4, 100, max_batches=2)))
