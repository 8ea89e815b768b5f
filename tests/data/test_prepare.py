"""`dropless prepare-data`: the prepared shards are the in-memory token streams (every source kind,
both tokenizers, both id widths), whatever the workers; an interrupted run resumes without redoing
finished work; bad input is refused naming the file and line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from dropless import cli
from dropless.data import prepare, prepare_units
from dropless.data.corpus import is_validation, jsonl_documents, source_files
from dropless.data.prepare import prepare_data
from dropless.data.prepare_plan import plan_units
from dropless.data.prepared import open_prepared
from dropless.data.tokenizer import ByteTokenizer, HFTokenizer

from prepare_cases import (expected_splits, joined, mapped, text, write_bpe, write_corpus, write_tables,
                           write_wide_vocab)

UNIT = 4096  # bytes per unit: the small corpora still make several units and cut the JSONL file


def _check_round_trip(sources: list[Path], out: Path, spec: str, tok, val: float = 0.3, **kw) -> dict:
    manifest = prepare_data(sources, out, tokenizer=spec, val_fraction=val, unit_bytes=UNIT, progress=False, **kw)
    train, val_runs = open_prepared(out, tok, val_fraction=val)
    want_train, want_val = expected_splits(sources, tok, val)
    np.testing.assert_array_equal(joined(train), want_train)
    np.testing.assert_array_equal(joined(val_runs), want_val)
    for r in train + val_runs:  # each document starts after the separator that ends the one before
        assert r.starts[0] == 0 and mapped(r.tokens, r) and r.loss is None
        sep = tok.encode("\n\n")
        for s in r.starts[1:]:
            assert list(r.tokens[s - len(sep):s]) == sep
    return manifest


def test_round_trip_byte(tmp_path: Path) -> None:
    sources = write_corpus(tmp_path)
    m = _check_round_trip(sources, tmp_path / "out", "byte", ByteTokenizer())
    assert m["dtype"] == "uint16" and m["tokenizer"] == {"kind": "byte", "vocab_size": 256}
    assert len([s for s in m["shards"] if s["split"] == "train"]) > 2  # several units, each its shards


def test_round_trip_hf_uint16_and_uint32(tmp_path: Path) -> None:
    sources = write_corpus(tmp_path)
    path = write_bpe(tmp_path / "bpe")
    m = _check_round_trip(sources, tmp_path / "out16", f"hf:{path}", HFTokenizer(path))
    assert m["dtype"] == "uint16"
    wide = write_wide_vocab(tmp_path / "wide")
    m = _check_round_trip(sources, tmp_path / "out32", f"hf:{wide}", HFTokenizer(wide))
    assert m["dtype"] == "uint32" and m["tokenizer"]["vocab_size"] == 70_000
    train, _ = open_prepared(tmp_path / "out32", HFTokenizer(wide), val_fraction=0.3)
    assert train[0].tokens.dtype == np.uint32 and int(joined(train).max()) >= 2**16


def test_shard_tokens_caps_shards(tmp_path: Path) -> None:
    sources = write_corpus(tmp_path)
    m = _check_round_trip(sources, tmp_path / "out", "byte", ByteTokenizer(), shard_tokens=700)
    for s in m["shards"]:  # a document longer than the cap is a shard alone
        assert s["num_tokens"] <= 700 or s["num_documents"] == 1


def test_split_by_document_name(tmp_path: Path) -> None:
    sources = write_corpus(tmp_path)
    m = prepare_data(sources, tmp_path / "out", val_fraction=0.3, unit_bytes=UNIT, progress=False)
    names = []
    for f in source_files(sources):
        if f.path.suffix == ".jsonl":
            names += [d.name for d in jsonl_documents(f.path, f.name, "text")]
        elif f.path.stat().st_size:
            names.append(f.name)
    n_val = sum(is_validation(n, 0.3) for n in names)
    assert 0 < n_val < len(names)
    assert m["totals"]["val"]["documents"] == n_val and m["totals"]["train"]["documents"] == len(names) - n_val


def test_jsonl_pieces_number_lines_as_the_whole_file(tmp_path: Path) -> None:
    sources = write_corpus(tmp_path)
    files = [f for f in source_files(sources) if f.path.suffix == ".jsonl"]
    whole = list(jsonl_documents(files[0].path, files[0].name, "text"))
    pieces = [p for u in plan_units(files, "text", UNIT) for p in u.pieces]
    assert len(pieces) > 3 and pieces[-1].stop == files[0].path.stat().st_size
    cut = [d for p in pieces
           for d in jsonl_documents(Path(p.path), p.name, "text", p.start, p.stop, p.first_line)]
    assert cut == whole


def test_parquet_and_arrow_sources(tmp_path: Path) -> None:
    tables = write_tables(tmp_path)
    sources = tables + write_corpus(tmp_path)[1:2]  # with a JSONL file between... and after
    out = tmp_path / "out"
    _check_round_trip(sources, out, "byte", ByteTokenizer())
    assert not (out / ".cache").exists() and not (out / ".units").exists()
    path = write_bpe(tmp_path / "bpe")
    _check_round_trip(tables, tmp_path / "out_hf", f"hf:{path}", HFTokenizer(path), workers=2)


def test_table_without_text_field_refused_before_writing(tmp_path: Path) -> None:
    parquet, arrow = write_tables(tmp_path)
    for src in (parquet, arrow):
        with pytest.raises(ValueError, match=rf"{src.name}.*no text field 'body'"):
            prepare_data([src], tmp_path / "out", text_field="body", progress=False)
        with pytest.raises(ValueError, match=rf"{src.name}.*field 'n' is .*expected a string column"):
            prepare_data([src], tmp_path / "out", text_field="n", progress=False)
    assert not (tmp_path / "out").exists()


def _shard_sums(manifest: dict) -> list:
    return [(s["split"], s["num_tokens"], {k: (f["name"], f["sha256"]) for k, f in s["files"].items()})
            for s in manifest["shards"]]


@pytest.mark.slow
def test_workers_do_not_change_the_shards(tmp_path: Path) -> None:
    sources = write_corpus(tmp_path)
    path = write_bpe(tmp_path / "bpe")
    one = prepare_data(sources, tmp_path / "w1", tokenizer=f"hf:{path}", unit_bytes=UNIT, progress=False)
    two = prepare_data(sources, tmp_path / "w2", tokenizer=f"hf:{path}", unit_bytes=UNIT, workers=2,
                       progress=False)
    assert len(one["shards"]) > 3 and _shard_sums(one) == _shard_sums(two)


def test_resume_after_interruption(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = write_corpus(tmp_path)
    out = tmp_path / "out"
    real = prepare.run_unit

    def interrupted(unit, job):
        if unit.index == 2:  # dies halfway through its first shard
            stage = prepare_units.unit_stage_dir(Path(job.out), unit.index)
            stage.mkdir(parents=True)
            (stage / "train-00000.tokens").write_bytes(b"\x01\x02\x03")
            raise KeyboardInterrupt
        return real(unit, job)

    monkeypatch.setattr(prepare, "run_unit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(sources, out, unit_bytes=UNIT, progress=False)
    assert not (out / "manifest.json").exists()
    done = {i: os.stat(out / ".units" / f"{i:06d}" / "train-00000.tokens") for i in (0, 1)}
    with pytest.raises(ValueError, match="unfinished run prepared with other settings: val_fraction"):
        prepare_data(sources, out, val_fraction=0.1, unit_bytes=UNIT, progress=False)

    ran = []
    monkeypatch.setattr(prepare, "run_unit", lambda unit, job: ran.append(unit.index) or real(unit, job))
    m = prepare_data(sources, out, unit_bytes=UNIT, progress=False)
    assert ran and 0 not in ran and 1 not in ran and 2 in ran
    first_train = [s["files"]["tokens"]["name"] for s in m["shards"] if s["split"] == "train"][:2]
    for name, st in zip(first_train, done.values()):  # renamed into place, never rewritten
        now = os.stat(out / name)
        assert (now.st_ino, now.st_mtime_ns, now.st_size) == (st.st_ino, st.st_mtime_ns, st.st_size)
    clean = prepare_data(sources, tmp_path / "clean", unit_bytes=UNIT, progress=False)
    assert _shard_sums(m) == _shard_sums(clean)

    ran.clear()
    before = {p.name: os.stat(p).st_mtime_ns for p in out.iterdir()}
    assert prepare_data(sources, out, unit_bytes=UNIT, progress=False) == m  # already prepared
    assert not ran and before == {p.name: os.stat(p).st_mtime_ns for p in out.iterdir()}


def test_loss_masks_from_a_producer_reach_the_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = write_corpus(tmp_path)
    real = prepare_units.text_token_docs

    def with_masks(docs, tokenizer, separator, dtype):
        for name, ids, _ in real(docs, tokenizer, separator, dtype):
            masked = name.startswith("rows.jsonl:") and int(name.split(":")[1]) % 2 == 0
            yield name, ids, (np.arange(len(ids)) % 2).astype(np.uint8) if masked else None

    monkeypatch.setattr(prepare_units, "text_token_docs", with_masks)
    prepare_data(sources, tmp_path / "out", val_fraction=0.0, unit_bytes=UNIT, progress=False)
    train, _ = open_prepared(tmp_path / "out", ByteTokenizer(), val_fraction=0.0)
    with_loss = [r for r in train if r.loss is not None]
    assert with_loss and any(r.loss is None for r in train)  # text-only shards write no .loss file
    for r in with_loss:
        assert r.loss.shape == r.tokens.shape
        ends = list(r.starts[1:]) + [len(r.tokens)]
        for s, e in zip(r.starts, ends):
            doc = np.asarray(r.loss[s:e])
            assert (doc == 1).all() or (doc == np.arange(e - s) % 2).all()
        assert (np.asarray(r.loss) == 0).any()


def test_bad_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    good = json.dumps({"text": text(1)})
    cases = {"not json": "invalid JSON", json.dumps({"body": "x"}): "no text field 'text'",
             json.dumps({"text": 3}): "field 'text' is int, expected str"}
    for i, (bad, why) in enumerate(cases.items()):
        src = tmp_path / f"bad{i}.jsonl"
        src.write_text("\n".join([good] * 200 + [bad] + [good] * 5) + "\n")
        out = tmp_path / f"out{i}"
        with pytest.raises(ValueError, match=rf"bad{i}.jsonl' line 201: {why}"):
            prepare_data([src], out, unit_bytes=UNIT, progress=False)
        assert not (out / "manifest.json").exists()


def test_refusals_before_writing(tmp_path: Path) -> None:
    sources = write_corpus(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        prepare_data(sources + [tmp_path / "missing.txt"], out, progress=False)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        prepare_data(sources, out, tokenizer=f"hf:{tmp_path / 'nowhere'}", progress=False)
    with pytest.raises(ValueError, match="--tokenizer='bpe'"):
        prepare_data(sources, out, tokenizer="bpe", progress=False)
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(ValueError, match="no text found"):
        prepare_data([tmp_path / "blank"], out, progress=False)
    assert not out.exists()
    only_blank = tmp_path / "blank.jsonl"
    only_blank.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="no text found"):
        prepare_data([only_blank], out, progress=False)
    assert not (out / "manifest.json").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty folder"):
        prepare_data(sources, tmp_path / "full", progress=False)


def test_finished_folder_with_other_settings_refused(tmp_path: Path) -> None:
    sources = write_corpus(tmp_path)
    out = tmp_path / "out"
    prepare_data(sources, out, progress=False)
    bpe = write_bpe(tmp_path / "bpe")
    with pytest.raises(ValueError, match="other settings: tokenizer: .*'byte'.*'hf'"):
        prepare_data(sources, out, tokenizer=f"hf:{bpe}", progress=False)
    with pytest.raises(ValueError, match="val_fraction: 0.05 there, 0.1 now"):
        prepare_data(sources, out, val_fraction=0.1, progress=False)
    with pytest.raises(ValueError, match="sources: "):
        prepare_data(sources[:2], out, progress=False)
    with open(sources[1], "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(ValueError, match=r"rows.jsonl' was \d+ bytes in 1 files, now"):
        prepare_data(sources, out, progress=False)


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sources = write_corpus(tmp_path)
    out = tmp_path / "out"
    argv = ["prepare-data", *map(str, sources), "--out", str(out), "--val-fraction", "0.2", "--no-progress"]
    assert cli.main(argv) == 0
    assert "prepared" in capsys.readouterr().out
    train, val = open_prepared(out, ByteTokenizer(), val_fraction=0.2)
    want_train, want_val = expected_splits(sources, ByteTokenizer(), 0.2)
    np.testing.assert_array_equal(joined(train), want_train)
    np.testing.assert_array_equal(joined(val), want_val)
    assert cli.main(argv) == 0
    assert "already prepared" in capsys.readouterr().err
    assert cli.main(argv[:-2] + ["0.3", "--no-progress"]) == 2
    assert "val_fraction: 0.2 there, 0.3 now" in capsys.readouterr().err

