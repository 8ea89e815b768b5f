"""The prepared-folder reader refuses what it cannot trust, naming the folder and the shard: another
tokenizer, another val fraction, an unfinished folder, a missing, truncated or corrupted file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dropless.data.prepare import prepare_data
from dropless.data.prepared import MANIFEST, file_sha256, open_prepared, token_dtype
from dropless.data.tokenizer import ByteTokenizer, HFTokenizer, tokenizer_identity

from prepare_cases import mapped, write_bpe, write_corpus


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    prepare_data(write_corpus(root), root / "out", val_fraction=0.25, unit_bytes=4096, progress=False)
    return root / "out"


@pytest.fixture
def copy(prepared: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "copy"))


def _first(folder: Path, kind: str = "tokens") -> Path:
    return folder / json.loads((folder / MANIFEST).read_text())["shards"][0]["files"][kind]["name"]


def test_opens_memory_mapped(prepared: Path) -> None:
    train, val = open_prepared(prepared, ByteTokenizer(), val_fraction=0.25)
    m = json.loads((prepared / MANIFEST).read_text())
    assert len(train) == m["totals"]["train"]["shards"] and len(val) == m["totals"]["val"]["shards"] > 0
    for r in train + val:
        assert mapped(r.tokens, r)
        assert r.starts.dtype == np.int64 and r.starts.flags.owndata and r.starts[0] == 0
    assert sum(len(r.tokens) for r in train) == m["totals"]["train"]["tokens"]


def test_other_tokenizer_refused(prepared: Path, tmp_path: Path) -> None:
    tok = HFTokenizer(write_bpe(tmp_path / "bpe"))
    with pytest.raises(ValueError, match=rf"{prepared.name}' was prepared with another tokenizer: "
                                         rf".*'byte'.*this run's is .*'hf'"):
        open_prepared(prepared, tok, val_fraction=0.25)


def test_other_val_fraction_refused(prepared: Path) -> None:
    with pytest.raises(ValueError, match="val_fraction=0.25.*val_fraction=0.05: set data.val_fraction=0.25 "
                                         "or prepare the data again"):
        open_prepared(prepared, ByteTokenizer(), val_fraction=0.05)


def test_unfinished_folder_refused(copy: Path) -> None:
    (copy / MANIFEST).unlink()
    with pytest.raises(ValueError, match=rf"{copy.name}': no manifest.json.*has not finished"):
        open_prepared(copy, ByteTokenizer(), val_fraction=0.25)


def test_corrupted_byte_refused_by_checksum(copy: Path) -> None:
    path = _first(copy)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    open_prepared(copy, ByteTokenizer(), val_fraction=0.25, verify=False)  # sizes alone cannot see it
    with pytest.raises(ValueError, match=rf"{copy.name}': corrupt or incomplete shard '{path.name}': its sha256"):
        open_prepared(copy, ByteTokenizer(), val_fraction=0.25)


@pytest.mark.parametrize("kind", ["tokens", "starts"])
def test_truncated_or_missing_file_refused_by_size(copy: Path, kind: str) -> None:
    path = _first(copy, kind)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 8)
    with pytest.raises(ValueError, match=rf"corrupt or incomplete shard '{path.name}': {size - 8} bytes, "
                                         rf"expected {size} bytes"):
        open_prepared(copy, ByteTokenizer(), val_fraction=0.25, verify=False)
    path.unlink()
    with pytest.raises(ValueError, match=rf"corrupt or incomplete shard '{path.name}': missing"):
        open_prepared(copy, ByteTokenizer(), val_fraction=0.25)


def test_identity_and_dtype_rules(tmp_path: Path) -> None:
    path = write_bpe(tmp_path / "bpe")
    ident = tokenizer_identity(HFTokenizer(path))
    assert ident["kind"] == "hf" and ident["sha256"] == file_sha256(path)
    assert ident["vocab_size"] == HFTokenizer(path).vocab_size
    copied = tmp_path / "elsewhere" / "tokenizer.json"
    copied.parent.mkdir()
    copied.write_bytes(path.read_bytes())
    assert tokenizer_identity(HFTokenizer(copied)) == ident  # where the file lies is not its identity
    assert [token_dtype(v) for v in (256, 65536, 65537)] == ["uint16", "uint16", "uint32"]
