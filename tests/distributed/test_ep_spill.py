"""Buffered EP with on_overflow="spill" (distributed/ep_spill.py) against the one-process layer.

Links sized far below the load (factor 0.3) so that most cases overflow: the pairs that did not fit
go through the second, exact-size exchange in the same call. Output, input gradient and every
parameter gradient must equal the one-process layer at the EP noise floor (tolerances.EP_REDUCED:
the same floor as exact mode, which is not bit-exact against one process either), with no pair
dropped. The cases are test_ep's (empty senders, uneven ranks, alignment padding, masked strategies);
the mxfp8 case is left out: spilled rows join their expert's group after the buffered ones, so the
32-token quantisation blocks hold other rows than one process's and EP_LOWP's reason does not hold.
Also: with links that fit (factor -1) spill mode spills nothing and matches too, and a recomputed
spill layer (non-reentrant checkpoint) gives bit-identical outputs and gradients.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from dist_harness import run_world
from dropless.config import MoEConfig, ParallelConfig
from dropless.distributed.parallelize_ep import shard_moe_layer
from dropless.layers.moe import MoELayer
from test_ep import _case_list, _check_parity, _run_case
from dropless.train.loop import Trainer
from tiny_run import tiny
from tolerances import EP_REDUCED, PARALLEL_TRAIN_LOSS


def _spill_cases(rank: int, world: int, **parallel: object) -> None:
    """test_ep's cases through the spill trip against one process; `parallel`: more settings of the EP
    layer (test_ep_capture_spill.py: the capturable layer)."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # a read of unwritten memory shows as NaN
    spilled_total = 0
    for case in _case_list(world):
        if case.get("precision"):
            continue
        for dedup in (False, True):
            for factor in (0.3, -1):
                tag = f"world={world} {case['name']} spill dedup={dedup} factor={factor} {parallel}"
                res = _run_case(rank, world, case, "buffered", dedup, factor, on_overflow="spill", **parallel)
                _check_parity(tag, res, EP_REDUCED)
                st = res["_stats"]
                assert int(st.pairs_dropped) == 0, tag
                assert int(st.pairs_computed) == res["_pairs_ref"], tag
                spilled = st.pairs_spilled.clone()
                dist.all_reduce(spilled)
                if factor == -1:
                    assert int(spilled) == 0, tag
                spilled_total += int(spilled)
                if case.get("force") and factor == 0.3:
                    assert int(spilled) > 0, tag  # every token on rank 0: the links must overflow
    assert spilled_total > 0


def _recompute_case(rank: int, world: int) -> None:
    torch.manual_seed(0)
    layer = MoELayer(8, MoEConfig(num_experts=8, top_k=3, d_expert=6))
    ep = shard_moe_layer(layer, None, ParallelConfig(ep_size=world, ep_mode="buffered", ragged_buffer_factor=0.3,
                                                     max_tokens_per_rank=9, on_overflow="spill"))
    gen = torch.Generator().manual_seed(rank)
    x, g = torch.randn(9, 8, generator=gen), torch.randn(9, 8, generator=gen)
    results = []
    for recompute in (False, True):
        twin = copy.deepcopy(ep)
        xs = x.clone().requires_grad_(True)
        y = checkpoint(lambda t: twin(t).y, xs, use_reentrant=False) if recompute else twin(xs).y
        (y * g).sum().backward()
        results.append([y.detach(), xs.grad] + [p.grad for p in twin.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    with torch.no_grad():
        st = ep(x).stats
    assert int(st.pairs_spilled) > 0 or world == 1


def _trainer_case(rank: int, world: int, root: Path, *spill_extra: str) -> None:
    """The trainer with spill: every token sent to rank 0's experts overflows links at factor 0.5; the
    steps are applied (no skip, no rerun), the check reports the spilled pairs, and the losses follow
    exact mode's (the same steps, every pair computed) at the EP noise floor. `spill_extra`: more
    settings of the spill run (test_ep_capture_spill.py: the capturable layer)."""
    base = ("model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0",
            "parallel.ep_size=2", "train.dtype=fp32", "train.steps=4")
    spill = ("parallel.ep_mode=buffered", "parallel.ragged_buffer_factor=0.5", "parallel.on_overflow=spill",
             *spill_extra)
    losses = {}
    for name, extra in (("exact", ()), ("spill", spill)):
        trainer = Trainer(tiny(*base, *extra), root / name)
        for layer in trainer.model.moe_layers():
            layer.router.set_bias(torch.tensor([1.0, 1.0, 0.0, 0.0]))
        losses[name] = [float(trainer.train_step(step)[0].loss) for step in range(3)]
        if name == "spill":
            row = trainer.overflow.check(2)
            assert row["ep_pairs_spilled"] > 0 and row["ep_steps_retried"] == 0, row
            assert int(trainer.overflow.skipped) == 0
    for a, b in zip(losses["exact"], losses["spill"]):
        assert abs(a - b) <= PARALLEL_TRAIN_LOSS * abs(a), losses


def _worker(rank: int, world: int, root: Path) -> None:
    _spill_cases(rank, world)
    _recompute_case(rank, world)
    _trainer_case(rank, world, root)


def test_spill_matches_single_process(tmp_path: Path) -> None:
    run_world(_worker, 2, tmp_path, tmp_path)
