"""Windows over token runs (data/windows.py): the text draw is batches.get_batch's, evaluation is
eval_batches', and document masking / loss masking put IGNORE_INDEX exactly where a target must take
no loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dropless.config import DataConfig
from dropless.data.batches import eval_batches, get_batch, load_splits
from dropless.data.corpus import Document
from dropless.data.splits import load_runs, text_run
from dropless.data.tokenizer import ByteTokenizer
from dropless.data.windows import IGNORE_INDEX, TokenRun, Windows


def _run(lengths: list[int], seed: int = 0, loss: bool = False) -> TokenRun:
    g = np.random.default_rng(seed)
    tokens = g.integers(1, 250, sum(lengths)).astype(np.uint16)
    starts = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)
    mask = g.integers(0, 2, sum(lengths)).astype(np.uint8) if loss else None
    return TokenRun(tokens, starts, mask)


def test_one_text_run_draws_get_batch_windows():
    splits = load_runs(DataConfig(max_bytes=40_000), ByteTokenizer(), 32)
    train_t, val_t = load_splits(None, ByteTokenizer(), max_bytes=40_000)
    assert np.array_equal(splits.train[0].tokens, train_t.numpy())
    w = Windows(splits.train, 32)
    for step, micro, rank in [(0, 0, 0), (7, 1, 0), (3, 2, 1)]:
        got = w.draw(step, micro, 4, 1234, rank=rank)
        x, y = get_batch(train_t, step, micro, 4, 32, 1234, rank=rank)
        assert torch.equal(got.x_BS, x) and torch.equal(got.y_BS, y) and got.segments_BS is None
    ev = list(Windows(splits.val, 32).evaluation(4, 3))
    ref = list(eval_batches(val_t, 4, 32, 3))
    assert len(ev) == len(ref)
    for a, (x, y) in zip(ev, ref):
        assert torch.equal(a.x_BS, x) and torch.equal(a.y_BS, y)


def test_text_run_starts_follow_documents():
    docs = [Document("a", b"hello"), Document("b", b"xy"), Document("c", b"world!")]
    run = text_run(docs, ByteTokenizer())
    assert bytes(run.tokens.tolist()) == b"hello\n\nxy\n\nworld!"
    assert run.starts.tolist() == [0, 7, 11]


def _reference(run: TokenRun, first: int, S: int, doc_mask: bool, loss: bool):
    """Per token, by the definitions: y[t] = token t+1, no loss if another document or unmarked."""
    doc = np.searchsorted(run.starts, np.arange(len(run.tokens)), side="right") - 1
    x, y, seg = [], [], []
    for t in range(S):
        i = first + t
        if i + 1 >= len(run.tokens):  # the run's last token has no target; then padding
            x.append(int(run.tokens[i]) if i < len(run.tokens) else 0)
            y.append(IGNORE_INDEX)
            continue
        x.append(int(run.tokens[i]))
        ok = (not doc_mask or doc[i + 1] == doc[i]) and (not loss or run.loss[i + 1])
        y.append(int(run.tokens[i + 1]) if ok else IGNORE_INDEX)
    return x, y


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("loss", [False, True])
def test_masks_match_definitions(aligned, loss):
    runs = [_run([5, 9, 1, 14, 3, 30], 0, loss), _run([40, 2, 7], 1, loss)]
    S = 12
    w = Windows(runs, S, aligned=aligned, document_mask=True, loss_masked=loss)
    for step in range(20):
        win = w.draw(step, 0, 3, 7)
        for b in range(3):
            xb = win.x_BS[b].tolist()
            seg = win.segments_BS[b]
            assert seg[0] == 0 and bool((seg[1:] >= seg[:-1]).all())
            # find the window's place: the run and first token whose tokens match
            found = False
            for run in runs:
                cands = run.starts if aligned else range(len(run.tokens) - S)
                for first in cands:
                    x, y = _reference(run, int(first), S, True, loss)
                    if x == xb and y == win.y_BS[b].tolist():
                        found = True
                        break
                if found:
                    break
            assert found, (step, b)
    # a document boundary inside a row puts a new segment at the boundary
    ev = next(iter(Windows([_run([5, 20])], 12, document_mask=True).evaluation(1, 1)))
    assert ev.segments_BS[0].tolist() == [0] * 5 + [1] * 7
    assert ev.y_BS[0, 4] == IGNORE_INDEX and (ev.y_BS[0, :4] != IGNORE_INDEX).all()


def test_aligned_windows_start_at_documents_and_pad():
    run = _run([3, 4, 2], 0, True)
    w = Windows([run], 8, aligned=True, document_mask=True, loss_masked=True)
    firsts = set()
    for step in range(30):
        win = w.draw(step, 0, 2, 0)
        for b in range(2):
            firsts.add(win.x_BS[b, 0].item())
    assert firsts == {int(run.tokens[s]) for s in run.starts}
    last = next(iter(w.evaluation(3, 1)))  # windows at documents 0, 1, 2; the last ones padded
    assert last.x_BS[2, 2:].tolist() == [0] * 6 and (last.y_BS[2, 1:] == IGNORE_INDEX).all()
    assert last.segments_BS[2].tolist() == [0, 0] + [1] * 6


def test_refusals():
    with pytest.raises(ValueError, match="fewer than train.seq_len"):
        Windows([_run([4, 4])], 8)
    with pytest.raises(ValueError, match="loss_on=all"):
        Windows([_run([20])], 8, loss_masked=True)


def test_prepared_windows_leave_the_resident_set_flat(tmp_path, monkeypatch):
    # every page a window reads is unmapped again after the batch (TokenRun.release): without it the
    # resident set grows with every distinct window (read-ahead and fault-around map pages around it)
    from dropless.data.prepare import prepare_data
    from dropless.data.prepared import open_prepared

    rng = np.random.default_rng(0)
    (tmp_path / "big.txt").write_bytes(rng.integers(97, 123, 24 << 20, dtype=np.uint8).tobytes())
    prepare_data([tmp_path / "big.txt"], tmp_path / "p", progress=False, val_fraction=0.0)
    train, _ = open_prepared(tmp_path / "p", ByteTokenizer(), val_fraction=0.0)

    def shard_rss_kb() -> int:
        total, inside = 0, False
        for line in open("/proc/self/smaps"):
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:  # a mapping's header line
                inside = len(head) >= 6 and head[-1].startswith(str(tmp_path / "p"))
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
        return total

    w = Windows(train, 256)
    for step in range(200):  # 3,200 windows over 48 MB of uint16 ids
        w.draw(step, 0, 16, 0)
    assert shard_rss_kb() < 64, shard_rss_kb()
    monkeypatch.setattr(TokenRun, "release", lambda self: None)  # the same draws, the pages left mapped
    for step in range(200, 400):
        w.draw(step, 0, 16, 0)
    assert shard_rss_kb() > 1024
