"""The pipeline's shape without processes: the spec's refusals, the balanced split (against brute
force; the MTP modules weighing on the last stage), the stage placement per schedule, what stages
take and refuse in a model."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dropless.config import load_config
from dropless.distributed.pipeline import check_model
from dropless.distributed.pipeline_split import block_cost, split_layers, stage_sizes, tail_cost
from dropless.pipeline_config import PipelineSpec
from dropless.model import MoEModel


@pytest.mark.parametrize("kwargs, field", [
    ({"pp_size": 0}, "parallel.pp_size"),
    ({"microbatches": 0}, "parallel.pp_microbatches"),
    ({"schedule": "dualpipe"}, "parallel.pp_schedule"),
    ({"schedule": "interleaved_1f1b"}, "parallel.pp_schedule"),  # one stage per rank
    ({"schedule": "zbv", "stages_per_rank": 3}, "parallel.pp_schedule"),
    ({"schedule": "gpipe", "stages_per_rank": 2}, "parallel.pp_stages_per_rank"),
    ({"schedule": "interleaved_1f1b", "stages_per_rank": 2, "pp_size": 2, "microbatches": 5},
     "parallel.pp_microbatches"),
    ({"pp_size": 2, "layers": (3,)}, "parallel.pp_layers"),
    ({"pp_size": 2, "layers": (3, 0)}, "parallel.pp_layers"),
])
def test_spec_refuses(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        PipelineSpec(**kwargs)


def test_spec_against_model_and_batch():
    with pytest.raises(ValueError, match=r"parallel\.pp_size=4: with parallel\.pp_stages_per_rank=1 that is 4 stages, more than"):
        PipelineSpec(4).check_model(3)
    with pytest.raises(ValueError, match=r"parallel\.pp_layers=\[2, 2\]: covers 4 blocks; the model has"):
        PipelineSpec(2, layers=(2, 2)).check_model(5)
    with pytest.raises(ValueError, match=r"parallel\.pp_microbatches=3: does not divide train\.batch_size=4"):
        PipelineSpec(2, microbatches=3).check_batch(4)
    # torch's Schedule1F1B needs a micro-batch per stage; gpipe runs fewer
    with pytest.raises(ValueError, match=r"parallel\.pp_microbatches=2: with parallel\.pp_schedule='1f1b' and pp_size=4"):
        PipelineSpec(4, "1f1b", 2).check_batch(4)
    PipelineSpec(4, "gpipe", 2).check_batch(4)
    PipelineSpec(2, layers=(2, 3)).check_model(5)
    PipelineSpec(2, microbatches=2).check_batch(4)


def test_stage_placement():
    assert [PipelineSpec(2, "1f1b").stages_of(r) for r in range(2)] == [[0], [1]]
    spec = PipelineSpec(3, "interleaved_1f1b", 3, stages_per_rank=2)
    assert [spec.stages_of(r) for r in range(3)] == [[0, 3], [1, 4], [2, 5]]
    spec = PipelineSpec(3, "zbv", 3, stages_per_rank=2)
    assert [spec.stages_of(r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]


def _brute(costs: list[float], n: int, head: float) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), n - 1):
        bounds = [0, *cuts, len(costs)]
        parts = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        parts[-1] += head
        best = min(best, max(parts))
    return best


def test_split_is_optimal():
    rng = random.Random(0)
    for _ in range(200):
        L = rng.randint(1, 9)
        n = rng.randint(1, L)
        costs = [rng.choice([1.0, 2.0, 5.0]) * rng.random() for _ in range(L)]
        head = rng.random() * 3
        sizes = split_layers(costs, n, head)
        assert len(sizes) == n and sum(sizes) == L and min(sizes) >= 1
        starts = [sum(sizes[:i]) for i in range(n)]
        parts = [sum(costs[s:s + k]) for s, k in zip(starts, sizes)]
        parts[-1] += head
        assert max(parts) == pytest.approx(_brute(costs, n, head))


def test_split_of_a_model_weighs_moe_blocks_and_head():
    cfg = load_config(None, ["model.n_layers=6", "model.n_dense_layers=2", "model.vocab_size=4096"]).model
    with torch.device("meta"):
        model = MoEModel(cfg)
    blocks = list(model.blocks)
    costs = [block_cost(b, 64) for b in blocks]
    assert costs[0] == costs[1] and costs[2] == costs[5] and costs[0] != costs[2]
    sizes = stage_sizes(PipelineSpec(3), blocks, 64, model.head.weight.numel())
    # the head's 2 x D x V per token is about one block here: the last stage takes fewer blocks
    assert sum(sizes) == 6 and sizes[-1] < max(sizes), sizes
    assert stage_sizes(PipelineSpec(3, layers=(1, 2, 3)), blocks, 64, 0) == [1, 2, 3]


def test_the_mtp_modules_weigh_on_the_last_stage():
    """The last stage pays the head and each MTP module (its block, its projection, the head again):
    with two MoE-block modules the last stage holds fewer blocks than without them."""
    base = ["model.n_layers=8", "model.n_dense_layers=0", "model.vocab_size=512", "model.mtp_block=moe",
            "model.moe.balance.global_aux_loss_coeff=0"]
    sizes = {}
    for depth in (0, 2):
        with torch.device("meta"):
            model = MoEModel(load_config(None, [*base, f"model.mtp_depth={depth}"]).model)
        head = model.head.weight.numel()
        want = 2.0 * head + sum(block_cost(m.block, 64) + 2.0 * m.proj.weight.numel() + 2.0 * head for m in model.mtp)
        assert tail_cost(head, list(model.mtp), 64) == want
        sizes[depth] = stage_sizes(PipelineSpec(2), list(model.blocks), 64, head, list(model.mtp))
    assert sizes[2][-1] < sizes[0][-1] and sum(sizes[2]) == 8, sizes


@pytest.mark.parametrize("override", ["model.mtp_depth=1", "model.moe.router.strategy=hash"])
def test_stages_take_what_reads_the_token_ids(override):
    """Multi-token prediction and hash routing run under stages (the ids travel with the activations:
    tests/distributed/test_pipeline.py); too few blocks is still refused by name."""
    cfg = load_config(None, [override, "model.n_layers=2"]).model
    with torch.device("meta"):
        model = MoEModel(cfg)
    check_model(PipelineSpec(2), model)
    with pytest.raises(ValueError, match=r"parallel\.pp_size=3: with parallel\.pp_stages_per_rank=1 that is 3 stages"):
        check_model(PipelineSpec(3), model)


def test_a_pipelined_config_at_pp_size_1_keeps_its_other_fields():
    """A pipelined run resumed in one process (`--set parallel.pp_size=1`): the split and the schedule
    it was trained with no longer apply, and are not refused."""
    cfg = load_config(None, ["parallel.pp_size=1", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2",
                             "parallel.pp_layers=[1,1,1,1]"])
    assert cfg.parallel.pp_size == 1
    with pytest.raises(ValueError, match=r"parallel\.pp_layers=\[1, 1, 1, 1\]: lists 4 stages"):
        load_config(None, ["parallel.pp_size=2", "parallel.pp_layers=[1,1,1,1]"])
