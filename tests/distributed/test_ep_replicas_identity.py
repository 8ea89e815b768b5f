"""Hot-expert replication with identity experts (world 2, EP 2, `parallel.replicate_hot_experts`).

Identity experts are selectable (ids E .. E+Z-1, counted by every layer) but compute nothing, so they
get no copies: the replicas plan over the E routed experts' counts only, and the run trains like the
unreplicated one (the neighbour test's tolerances: an expert's gradient is summed from two parts).
The logged run exercises the layer's detailed statistics with both at once: the copies' rows folded
into their experts, then the identity experts' entries after the routed ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_harness import run_world
from dropless.expert_slots import ExpertSlots
from dropless.train.loop import Trainer
from tiny_run import tiny
from tolerances import PARALLEL_TRAIN_GRAD_NORM, PARALLEL_TRAIN_LOSS

E, Z = 4, 2
BASE = (f"model.moe.n_identity_experts={Z}", "model.moe.router.use_expert_bias=true",
        "model.moe.balance.bias_update_rate=0", "parallel.ep_size=2", "train.dtype=fp32", "train.steps=6",
        "train.ckpt_every=1000", "train.eval_every=6")
REPL = ("parallel.replicate_hot_experts=1", "parallel.replica_interval=2")


def _trainer(root: Path, name: str, extra: tuple[str, ...]) -> Trainer:
    trainer = Trainer(tiny(*BASE, *extra), root / name)
    # every token picks identity expert 4 and one of rank 0's experts 0, 1: expert 4 is the busiest of
    # all, but a copy of it would be meaningless (and has no slot), so the plan must skip to expert 0/1
    for layer in trainer.model.moe_layers():
        layer.router.set_bias(torch.tensor([0.3, 0.3, 0.0, 0.0, 2.0, 0.0]))
    return trainer


def _worker(rank: int, world: int, root: Path) -> None:
    plain, rep = _trainer(root, "plain", ()), _trainer(root, "rep", REPL)
    assert rep.layout.replicas is not None  # sharding, then replication, replaced the layers' slots
    assert all(layer.slots == ExpertSlots(E, Z, ep_size=2) for layer in plain.model.moe_layers())
    assert rep.layout.replicas.slots == ExpertSlots(E, Z, ep_size=2, spare=1)
    assert all(layer.slots == rep.layout.replicas.slots for layer in rep.model.moe_layers())
    plain.fit()
    rep.fit()


def _metric(run: Path, key: str) -> list:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


@pytest.mark.slow
def test_replicas_with_identity_experts_train_like_the_plain_run(tmp_path: Path) -> None:
    run_world(_worker, 2, tmp_path, tmp_path)
    plain, rep = tmp_path / "plain", tmp_path / "rep"
    for key, tol in (("loss", PARALLEL_TRAIN_LOSS), ("grad_norm", PARALLEL_TRAIN_GRAD_NORM)):
        a, b = _metric(plain, key), _metric(rep, key)
        assert len(a) == len(b) == 6
        assert max(abs(x - y) / abs(x) for x, y in zip(a, b)) <= tol, (key, a, b)
    placements = _metric(rep, "replica_placement")
    assert len(placements) == 3
    copies = [c for p in placements for layer in p for c in layer]
    assert copies and all(expert < E for expert, _, _ in copies)  # routed experts only
    # the routing rows count every selectable expert, and the identity experts were chosen
    rows = [json.loads(line) for line in (rep / "routing.jsonl").read_text().splitlines()]
    counts = [layer["counts"] for r in rows for layer in r["layers"]]
    assert all(len(c) == E + Z for c in counts) and sum(c[E] + c[E + 1] for c in counts) > 0
