"""Routing replay under buffered expert parallelism: the record's sequences may be longer than
train.seq_len (up to model.max_seq_len), so a replayed micro-batch may hold more tokens than the
batch_size x seq_len that buffered EP sizes its fixed buffers from by default."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from dist_harness import run_world
from dropless.data.routing_record import RoutingRecord
from dropless.model import MoEModel
from dropless.train.loop import Trainer
from tiny_run import tiny

CFG = ["parallel.ep_size=2", "parallel.ep_mode=buffered", "train.seq_len=16", "train.batch_size=2",
       "train.steps=2", "train.eval_every=100", "train.ckpt_every=100"]


def _record(path: Path) -> None:
    """Sequences of 30 tokens (29 inputs each: a micro-batch of 58 > 2 x 16), every token on experts
    0..K-1."""
    cfg = tiny(*CFG).model
    seqs = [torch.arange(30) * 7 % 256 + i for i in range(4)]
    ids = [torch.arange(cfg.moe.top_k).expand(cfg.n_moe_layers, 30, cfg.moe.top_k) for _ in seqs]
    RoutingRecord.for_model(MoEModel(cfg), seqs, ids, "hand-made").save(path)


def _train(rank: int, world: int, run_dir: Path, record: Path) -> None:
    Trainer(tiny(*CFG, f"data.replay_routing={record}"), run_dir).fit()


def test_buffered_ep_replays_sequences_longer_than_seq_len(tmp_path: Path) -> None:
    _record(tmp_path / "r.rec")
    run_world(_train, 2, tmp_path, tmp_path / "run", tmp_path / "r.rec")
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
