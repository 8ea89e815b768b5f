"""Overlap of the shared experts with the dispatch all-to-all (parallel.overlap_shared).

The overlapped layer issues the token rows' all-to-all (`comm.all_to_all_start`), computes the shared
experts, then waits; the backward issues the reverse exchange before the shared experts' backward
and waits after it. The same collectives on the same data: output, input gradient and every
parameter gradient must equal the blocking layer's bit for bit (torch.equal), in exact and buffered
mode, with and without de-dup, and with spill when links overflow. Both runs are watched
(distributed/watch.py, check mode): the overlapped one must record the same collectives (count and
digest) and time its all-to-alls; buffered mode (without spill) must not read the host, and exact
and spill modes only where tests/host_sync.py allows them.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from dist_harness import run_world
from host_sync import EP_EXACT_SPLIT_SIZES, EP_SPILL_TOTAL, Allowance, forbid_host_sync
from dropless.config import MoEConfig, ParallelConfig
from dropless.distributed import comm
from dropless.distributed.parallelize_ep import shard_moe_layer
from dropless.distributed.watch import CommWatch
from dropless.layers.moe import MoELayer

MODES = [("exact", 2.0, "retry"), ("buffered", -1, "retry"), ("buffered", 0.3, "spill")]
# buffered without spill never reads the host, overlapped or not; exact mode reads its split sizes,
# spill its overflow total and then, for the second exchange, exact mode's split sizes
ALLOWED = {("exact", "retry"): (EP_EXACT_SPLIT_SIZES,), ("buffered", "retry"): (),
           ("buffered", "spill"): (EP_SPILL_TOTAL, EP_EXACT_SPLIT_SIZES)}


def _run(layer: MoELayer, x: torch.Tensor, g: torch.Tensor, allow: tuple[Allowance, ...],
         ) -> tuple[list[torch.Tensor], CommWatch]:
    watch = CommWatch({"ep": None}, x.device, check=True)
    xs = x.clone().requires_grad_(True)
    with watch.step(0), forbid_host_sync("overlapped EP read the host", allow):
        out = layer(xs)
        (out.y * g).sum().backward()
    return [out.y.detach(), xs.grad] + [p.grad for p in layer.parameters()], watch


def _cases(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    T = 11 + 3 * rank  # uneven ranks
    started = []
    start = comm.all_to_all_start
    comm.all_to_all_start = lambda *a, **k: started.append(1) or start(*a, **k)  # the async path ran
    for mode, factor, policy in MODES:
        for dedup in (False, True):
            tag = f"{mode} factor={factor} {policy} dedup={dedup}"
            torch.manual_seed(0)
            layer = MoELayer(8, MoEConfig(num_experts=8, top_k=3, d_expert=6, n_shared_experts=2))
            gen = torch.Generator().manual_seed(10 + rank)
            x, g = torch.randn(T, 8, generator=gen), torch.randn(T, 8, generator=gen)
            results, started[:] = [], []
            for overlap in (False, True):
                cfg = ParallelConfig(ep_size=world, ep_mode=mode, dedup=dedup, ragged_buffer_factor=factor,
                                     max_tokens_per_rank=20, on_overflow=policy, overlap_shared=overlap)
                ep = shard_moe_layer(copy.deepcopy(layer), None, cfg)
                assert ep.dispatcher.overlap_shared is overlap
                results.append(_run(ep, x, g, ALLOWED[mode, policy]))
            (plain, w0), (over, w1) = results
            assert len(plain) == len(over)
            for i, (a, b) in enumerate(zip(plain, over)):
                assert a is not None and torch.equal(a, b), f"{tag}: tensor {i} differs"
            assert (w1.log.count, w1.log.digest) == (w0.log.count, w0.log.digest), tag
            assert w0.log.count > 0 and w1._a2a_s > 0, tag
            assert len(started) == 2, tag  # token rows and their metadata, overlapped run only


def _trainer_case(rank: int, world: int, root: Path) -> None:
    """The trainer (EP 2 with FSDP, shared experts, watched with fingerprint checks): three steps'
    losses and gradient norms overlapped equal the blocking run's bit for bit."""
    from dropless.train.loop import Trainer
    from tiny_run import tiny
    runs = {}
    for overlap in (False, True):
        cfg = tiny("model.moe.n_shared_experts=1", "parallel.ep_size=2", "train.dtype=fp32",
                   "parallel.check_collectives=true", f"parallel.overlap_shared={str(overlap).lower()}")
        trainer = Trainer(cfg, root / f"overlap_{overlap}")
        assert all(m.dispatcher.overlap_shared is overlap for m in trainer.model.moe_layers())
        out = []
        for step in range(3):
            with trainer.layout.comm_watch.step(step, check=True):
                sums, norm = trainer.train_step(step, log_step=True)
            out += [float(sums.loss), float(norm)]
        runs[overlap] = out
    assert runs[True] == runs[False], runs


def _worker(rank: int, world: int, root: Path) -> None:
    _cases(rank, world)
    _trainer_case(rank, world, root)


def test_overlap_bit_identical(tmp_path: Path) -> None:
    run_world(_worker, 2, tmp_path, tmp_path)


def test_overlap_config() -> None:
    import pytest
    with pytest.raises(ValueError, match="parallel.overlap_shared"):
        ParallelConfig(overlap_shared="yes")
