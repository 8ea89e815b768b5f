"""The quality knobs (identity experts, LatentMoE, multi-token prediction) under expert parallelism:
a world of 2 (EP 2, gloo, CPU) trains as one process does on the same global batch (the data layout of
test_parallel_train.py: rank r's micro-batch m is one process's micro-batch m * W + r).

Identity experts are routed ids >= E: they must never be dispatched (no rank owns them) and must be
counted in every rank's routing statistics; LatentMoE dispatches l-wide rows; the MTP modules are
dense and replicated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_harness import run_world
from dropless.train.loop import Trainer
from tiny_run import tiny as tiny_base
from tolerances import PARALLEL_TRAIN_GRAD_NORM, PARALLEL_TRAIN_LOSS

KNOBS = {
    "identity_mtp": ("model.moe.n_identity_experts=2", "model.mtp_depth=1"),
    "latent": ("model.moe.latent_dim=16", "model.moe.latent_norm=true"),
}
SLOW = {"latent", "identity_mtp"}  # the default preset's knobs run in the fast suite


def tiny(knob: str, *extra: str):
    return tiny_base("train.eval_every=20", "train.dtype=fp32", "train.steps=12", *KNOBS[knob], *extra)


def metric(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def _train_2(rank: int, world: int, run_dir: Path, knob: str) -> None:
    Trainer(tiny(knob, "parallel.ep_size=2"), run_dir).fit()


@pytest.mark.parametrize("knob", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in KNOBS])
def test_knob_under_ep_follows_one_process(tmp_path: Path, knob: str) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    Trainer(tiny(knob, "train.grad_accum=2"), one).fit()
    run_world(_train_2, 2, tmp_path, two, knob)
    for key, tol in (("loss", PARALLEL_TRAIN_LOSS), ("grad_norm", PARALLEL_TRAIN_GRAD_NORM)):
        got, ref = metric(two, key), metric(one, key)
        assert len(got) == len(ref) == 12
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        assert worst <= tol, (key, worst)
    assert metric(two, "val_loss") and abs(metric(two, "val_loss")[-1] / metric(one, "val_loss")[-1] - 1) <= PARALLEL_TRAIN_LOSS
    # the routing rows count the global pairs, identity experts included: the first step's routing
    # (before any update, the same logits) exactly; later ones can differ at near-ties (fp32 rounding of
    # the reduced gradients), so only their totals are compared
    rows = [json.loads(line) for line in (two / "routing.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(line) for line in (one / "routing.jsonl").read_text().splitlines()]
    E = 4 + (2 if knob == "identity_mtp" else 0)
    assert [layer["counts"] for layer in rows[0]["layers"]] == [layer["counts"] for layer in ref_rows[0]["layers"]]
    for r, ref in zip(rows, ref_rows, strict=True):
        for layer, ref_layer in zip(r["layers"], ref["layers"], strict=True):
            assert len(layer["counts"]) == E and sum(layer["counts"]) == sum(ref_layer["counts"])
    if knob == "identity_mtp":  # the identity experts were chosen, and counted, on the EP ranks too
        assert sum(layer["counts"][4] + layer["counts"][5] for r in rows for layer in r["layers"]) > 0
