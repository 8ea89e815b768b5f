"""The routing record (routing.jsonl) of a distributed run counts every token once.

W gloo ranks with grad_accum 1 see the global batch of one process with grad_accum W (rank r's
micro-batch is the one-process micro-batch r, tests/distributed/test_parallel_train.py). The record of
step 0 is compared with that one process field by field:
- `counts` sum to exactly the pairs routed in the step (tokens x top_k, token choice is dropless):
  a count reduced over the ranks twice is W times too large, which no float noise explains;
- the step-0 forward sees the same weights and the same tokens, so the routing decisions are those
  of the one process (`counts`, tokens min/median/max compared with ==); the float fields (aux loss,
  entropy, output RMS ratios, MaxVio) at the fp32 noise floor of a different summation order.
W=2 is pure data parallelism (FSDP); W=4 adds expert parallelism (ep 2 x edp 2), where each rank's
output statistics cover its own experts only and must still add up to the whole.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dist_harness import run_world
from dropless.train.loop import Trainer
from tiny_run import tiny as tiny_base

# fp32 (parity at the noise floor), 2 steps, every step a log step; step 0's record is compared.
COMMON = ("train.dtype=fp32", "train.steps=2", "train.warmup_steps=1", "train.eval_every=2",
          "train.eval_batches=1")

# Float fields of a layer's record: sums over the same tokens in another order (EP: per rank, then
# over ranks). The step-0 values of the tiny model differ from one process by ~1e-7 relative
# (PARALLEL_TRAIN_LOSS explains the order); entropy and top1/top2 are means of per-micro-batch means.
FLOAT_FIELDS = ("maxvio_local", "maxvio_global", "aux_loss", "entropy", "top1_top2",
                "rms_max_over_median", "rms_min_over_median")
INT_FIELDS = ("counts", "tokens_min", "tokens_median", "tokens_max", "dropped")
REL = 1e-5  # relative: 100x the float32 ulp, far below the factor W the bug multiplied by


def _train(rank: int, world: int, run_dir: Path, extra: tuple[str, ...]) -> None:
    Trainer(tiny_base(*COMMON, *extra), run_dir).fit()


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "routing.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("world,ep", [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_routing_record_counts_each_token_once(tmp_path: Path, world: int, ep: int) -> None:
    one = tmp_path / "one"
    Trainer(tiny_base(*COMMON, f"train.grad_accum={world}"), one).fit()
    run_world(_train, world, tmp_path, tmp_path / "dist", (f"parallel.ep_size={ep}",))
    ref, got = _rows(one), _rows(tmp_path / "dist")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [0, 1]
    cfg = tiny_base(*COMMON)
    pairs_per_step = world * cfg.train.batch_size * cfg.train.seq_len * cfg.model.moe.top_k
    for row in got:
        for layer in row["layers"]:
            assert sum(layer["counts"]) == pairs_per_step, (row["step"], layer["counts"])
    for i, (a, b) in enumerate(zip(got[0]["layers"], ref[0]["layers"])):
        for key in INT_FIELDS:
            assert a[key] == b[key], (i, key, a[key], b[key])
        for key in FLOAT_FIELDS:
            assert math.isclose(a[key], b[key], rel_tol=REL, abs_tol=REL), (i, key, a[key], b[key])
