"""Recompute and offload under expert parallelism (world 2, gloo, CPU fp32): the same bits as the
plain EP run at the same world size.

A recomputed MoE layer repeats its all-to-alls in the backward (layers/recompute.py): every rank
reruns the same region with the forward's expert ids and the forward's dispatcher, so the same rows
travel and the same kernels run on the same inputs (torch.equal, docs/numerics.md). Buffered mode
with buffers too small for the routing drops the same pairs in the recompute as in the forward; the
trainer's retry reruns the whole step with worst-case buffers, recompute included.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

import torch.distributed as dist

from dist_harness import run_world
from dropless.bench.ep import fwd_bwd_fn, trip_bytes
from dropless.config import ParallelConfig
from dropless.distributed.ep import EPDispatcher
from dropless.layers.router import RoutingDecision
from dropless.distributed.parallelize_ep import shard_moe_layer
from dropless.model import MoEModel
from dropless.train.loop import Trainer
from test_parallel_train import BUFFERED, _local_state, _skew
from tiny_run import tiny

B, S = 2, 16
# (recompute, offload) against the plain run
VARIANTS = [(["moe"], []), (["layer"], []), (["attn", "norm"], ["moe"]), ([], ["layer"])]


def _model(cfg, recompute: list[str], offload: list[str], par: ParallelConfig) -> MoEModel:
    torch.manual_seed(0)
    model = MoEModel(replace(cfg, recompute=recompute, offload=offload))
    for i, layer in enumerate(model.moe_layers()):
        layer.router.set_bias(torch.randn(8, generator=torch.Generator().manual_seed(i)))
        shard_moe_layer(layer, None, par)
    return model


def _fwd_bwd(model: MoEModel, tok: torch.Tensor, replay: list[torch.Tensor] | None) -> dict:
    out = model(tok, tok, replay)
    for layer in model.moe_layers():  # a router that moved would choose other experts: not replayed
        layer.router.set_bias(-10 * layer.router.expert_bias)
    out.loss.backward()
    res = {"logits": out.logits, "loss": out.loss}
    for i, m in enumerate(out.moe):
        res.update({f"ids{i}": m.ids_TK, f"dropped{i}": m.stats.pairs_dropped})
    res.update({f"grad.{n}": p.grad for n, p in model.named_parameters()})
    return res


def _model_cases(rank: int, world: int) -> None:
    cfg = tiny("model.moe.num_experts=8", "model.moe.n_shared_experts=1",
               "model.moe.router.use_expert_bias=true").model
    tok = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(10 + rank))
    g = torch.Generator().manual_seed(20 + rank)
    replay_ids = [torch.rand(B, S, 8, generator=g).argsort(-1)[..., :2] for _ in range(cfg.n_moe_layers)]
    overflowed = False
    for mode, factor in (("exact", 2.0), ("buffered", 0.25)):  # 0.25: links too small, pairs dropped
        for dedup in (True, False):
            par = ParallelConfig(ep_size=world, ep_mode=mode, dedup=dedup, ragged_buffer_factor=factor,
                                 max_tokens_per_rank=B * S)
            for replay in (None, replay_ids) if dedup else (None,):
                ref = _fwd_bwd(_model(cfg, [], [], par), tok, replay)
                overflowed |= bool(sum(v for k, v in ref.items() if k.startswith("dropped")) > 0)
                for recompute, offload in VARIANTS:
                    got = _fwd_bwd(_model(cfg, recompute, offload, par), tok, replay)
                    for k in ref:
                        assert torch.equal(got[k], ref[k]), (mode, dedup, replay is None, recompute, offload, k)
    assert overflowed  # the buffered cases did drop pairs
    _traffic_cases(rank, world)


def _traffic_cases(rank: int, world: int) -> None:
    """bench ep's byte counts against the bytes the all-to-alls really send, summed over ranks (a
    rank's backward sends what it received in the forward): plain fwd+bwd sends the count exchange
    once and the dispatch and combine trips twice (forward, reversed backward); the recompute adds
    the forward's three trips (on each rank)."""
    T, D, E, K = 12, 8, 8, 3
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g).bfloat16()
    logits = torch.randn(T, E, generator=g)
    ids = logits.topk(K, -1).indices
    real = dist.all_to_all_single
    sent = [0]

    def counted(output, input, *args, **kwargs):
        sent[0] += input.numel() * input.element_size()
        return real(output, input, *args, **kwargs)

    dist.all_to_all_single = counted
    try:
        for mode in ("exact", "buffered"):
            for dedup in (True, False):
                disp = EPDispatcher(E, None, mode=mode, dedup=dedup, max_tokens=T)
                with torch.no_grad():
                    scores = torch.softmax(logits, -1)
                    _, meta = disp.dispatch(x, RoutingDecision(ids, scores.gather(1, ids), scores, logits))
                trips = trip_bytes(meta, x, world, E // world)
                fwd = trips["counts"] + trips["dispatch"] + trips["combine"]
                measured = []
                for recompute in (False, True):
                    sent[0] = 0
                    fwd_bwd_fn(disp, x, logits, ids, recompute)()
                    measured.append(sent[0])
                assert measured[1] - measured[0] == int(fwd), (mode, dedup, measured, trips)
                totals = torch.tensor([measured[0], int(fwd + trips["dispatch"] + trips["combine"])])
                dist.all_reduce(totals)  # (measured, counted), each summed over ranks
                assert totals[0] == totals[1], (mode, dedup, totals)
    finally:
        dist.all_to_all_single = real


def test_recompute_and_offload_under_ep_are_bit_identical(tmp_path: Path) -> None:
    run_world(_model_cases, 2, tmp_path)


def _retry_cases(rank: int, world: int, root: Path) -> None:
    """An overflowing buffered step, rerun with worst-case buffers: the same state with recompute, and
    with offload of the FSDP-wrapped experts (scopes by forward hooks, beside FSDP's own)."""
    states = []
    for extra in ([], ['model.recompute=["layer"]'], ['model.recompute=["moe"]'],
                  ['model.offload=["experts","attn_input"]']):
        t = Trainer(tiny(*BUFFERED, *extra), root / str(len(states)))
        _skew(t)
        t.train_step(0)
        assert t.overflow.retried == 1
        if t.model.offloader is not None:
            assert t.model.offloader.counter.bytes_to_host > 0
        states.append(_local_state(t))
    for other in states[1:]:
        assert all(torch.equal(a, b) for a, b in zip(states[0], other))


def test_recompute_in_buffered_retry_step(tmp_path: Path) -> None:
    run_world(_retry_cases, 2, tmp_path, tmp_path)
