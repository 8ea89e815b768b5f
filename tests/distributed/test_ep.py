"""The EP dispatcher against the single-process MoE layer, on gloo worlds of 2 and 4 processes.

Every worker builds the same reference layer (same seed), runs it one process, then shards a copy
with `shard_moe_layer` and runs its own slice of the batch through expert parallelism. Compared: the
output slice, the input gradient slice, the local experts' weight gradients against the matching
slice of the reference's, and the router and shared-expert gradients summed over ranks (the
data-parallel reduction a trainer would do).

Which one-process run is the reference: every EP rank routes its own micro-batch (the router is
replicated; nothing about routing crosses ranks). Token-choice routing is per token, so the
reference runs the whole global batch at once. Expert choice is not: an expert takes its top-C
tokens of the batch it sees, so under EP that is rank r's micro-batch, and the reference is the
one-process layer run on each rank's tokens separately ("per_rank"), its parameter gradients
accumulated over those runs (what data parallelism without EP computes). The expert weight gradient
of expert e then sums every rank's pairs for e, exactly what the EP destination computes.

One spawn per world size runs every case, because starting interpreters is what costs time here.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_world
from dropless.config import MoEConfig, ParallelConfig, RouterConfig
from dropless.distributed import comm
from dropless.distributed.ep import EPDispatcher, link_capacity, local_expert_count, must_invalidate
from dropless.distributed.parallelize_ep import shard_moe_layer
from dropless.layers.dispatch import DispatchMeta
from dropless.layers.moe import MoELayer
from dropless.layers.router import RoutingDecision
from dropless.ops import routing
from tolerances import EP_LOWP, EP_REDUCED, assert_close

MODES = [(mode, dedup) for mode in ("exact", "buffered") for dedup in (False, True)]


def _case_list(world: int) -> list[dict]:
    uneven = [4, 7, 1, 6][:world]
    return [
        # router-chosen routing, k=3 over E=8: tokens often pick two experts on one rank (de-dup path)
        dict(name="router", T=[6] * world, E=8, K=3),
        # alignment padding inside every destination group, and shared experts (replicated weights)
        dict(name="align_shared", T=[5] * world, E=8, K=2, align=4, n_shared_experts=1, d_shared=4),
        # every token on rank 0's experts: the other ranks receive nothing and compute empty groups
        dict(name="all_on_rank0", T=[6] * world, E=2 * world, K=2, force="rank0"),
        # one rank has no tokens at all (sends nothing; buffered: the others' T sizes nothing)
        dict(name="empty_sender", T=[0] + [5] * (world - 1), E=8, K=2),
        # ... and still runs its shared experts on zero rows
        dict(name="empty_sender_shared", T=[0] + [5] * (world - 1), E=8, K=2, n_shared_experts=1, d_shared=4),
        # uneven token counts (a last batch, dynamic padding), buffers sized from a bound above all of them
        dict(name="uneven", T=uneven, E=8, K=2, bound=max(uneven) + 3),
        # k = E with one expert per rank: every token goes to every rank; padded groups
        dict(name="kE_one_expert_per_rank", T=[5] * world, E=world, K=world, align=4),
        # the ranks that receive nothing still hold padded (empty) groups
        dict(name="all_on_rank0_align", T=[6] * world, E=2 * world, K=2, force="rank0", align=4),
        # variable experts per token (valid_TK, K = E slots): invalid slots get no row, no traffic
        dict(name="expert_choice", T=[7] * world, E=8, K=2, strategy="expert_choice", reference="per_rank"),
        dict(name="expert_choice_uneven", T=uneven, E=8, K=2, strategy="expert_choice", reference="per_rank",
             n_shared_experts=1, d_shared=4),
        dict(name="expert_threshold", T=[6] * world, E=8, K=2, strategy="expert_threshold",
             reference="per_rank", align=4),
        dict(name="expert_threshold_cap", T=uneven, E=8, K=2, strategy="expert_threshold",
             max_experts_per_token=3, reference="per_rank"),
        # low precision: groups padded to the 32-token block the experts declare (cfg.align stays 1);
        # the router sees exact dyadic inputs, so its logits do not depend on the batch (see EP_LOWP)
        dict(name="mxfp8", T=[20, 9, 14, 3][:world], E=2 * world, K=2, precision="mxfp8", d=32, f=32,
             dyadic=True),
    ]


def _layer_cfg(case: dict) -> MoEConfig:
    router = RouterConfig(strategy=case.get("strategy", "token_choice"),
                          max_experts_per_token=case.get("max_experts_per_token"))
    return MoEConfig(num_experts=case["E"], top_k=case["K"], d_expert=case.get("f", 6),
                     align=case.get("align", 1), n_shared_experts=case.get("n_shared_experts", 0),
                     d_shared=case.get("d_shared", 0), precision=case.get("precision", "bf16"), router=router)


def _inputs(case: dict, world: int, ref: MoELayer):
    T_r, E, K, d = case["T"], case["E"], case["K"], case.get("d", 8)
    gen = torch.Generator().manual_seed(1)
    T = sum(T_r)
    if case.get("dyadic"):
        # x in k/8, router weights in k/16, d = 32: every logit is an exact fp32 sum in any order
        x = torch.randint(-8, 9, (T, d), generator=gen).float() / 8
        with torch.no_grad():
            ref.router.weight.copy_(torch.randint(-4, 5, ref.router.weight.shape, generator=gen).float() / 16)
    else:
        x = torch.randn(T, d, generator=gen)
    g = torch.randn(T, d, generator=gen)
    ids = None
    if case.get("force") == "rank0":
        L = E // world
        ids = torch.stack([torch.randperm(L, generator=gen)[:K] for _ in range(T)])
    if case.get("strategy") == "expert_threshold":
        # thresholds from a past batch (scaled down: several experts per token), so slots vary
        with torch.no_grad():
            scores = ref.router(torch.randn(64, d, generator=gen)).scores_TE
        ref.router.update_threshold(routing.score_quantile(scores, K) * 0.7)
    return x, g, ids


def _link_factor(case: dict, world: int, ref: MoELayer, x: torch.Tensor, ids: torch.Tensor | None,
                 bound: int) -> float:
    """The smallest ragged_buffer_factor at which no link overflows: the busiest link's load, with the
    routing each rank computes on its own slice. Most links then have empty slots."""
    T_r, E = case["T"], case["E"]
    L = E // world
    loads = torch.zeros(world, world, dtype=torch.int64)
    slots = case["K"]
    with torch.no_grad():
        for s in range(world):
            lo, hi = sum(T_r[:s]), sum(T_r[:s + 1])
            if hi == lo:
                continue
            dec = ref.router(x[lo:hi], None if ids is None else ids[lo:hi])
            valid = torch.ones_like(dec.ids_TK, dtype=torch.bool) if dec.valid_TK is None else dec.valid_TK
            loads[s] += torch.bincount((dec.ids_TK[valid] // L).reshape(-1), minlength=world)
            slots = dec.ids_TK.shape[1]  # K = E slots for the variable-count strategies
    busiest = max(int(loads.max()), 1)
    factor = busiest * world / (bound * case["K"])
    assert link_capacity(bound, case["K"], L, world, factor, slots) >= busiest
    return factor


def _run(layer: MoELayer, xs: torch.Tensor, gs: torch.Tensor, ids_s: torch.Tensor | None):
    xs = xs.detach().clone().requires_grad_(True)
    out = layer(xs, replay_ids=ids_s)
    (out.y * gs).sum().backward()
    return out, xs.grad


def _run_case(rank: int, world: int, case: dict, mode: str, dedup: bool, factor: float | str,
              on_overflow: str = "retry", hier: tuple | None = None, **parallel: object) -> dict:
    T_r, E = case["T"], case["E"]
    torch.manual_seed(0)
    ref = MoELayer(case.get("d", 8), _layer_cfg(case))
    x, g, ids = _inputs(case, world, ref)
    lo, hi = sum(T_r[:rank]), sum(T_r[:rank + 1])
    bound = case.get("bound", max(T_r))
    if factor == "tight":
        factor = _link_factor(case, world, ref, x, ids, bound) if mode == "buffered" else 2.0
    ep = shard_moe_layer(copy.deepcopy(ref), None, ParallelConfig(
        ep_size=world, ep_mode=mode, dedup=dedup, ragged_buffer_factor=factor, max_tokens_per_rank=bound,
        on_overflow=on_overflow, **parallel), hier)
    if case.get("reference") == "per_rank":  # routing depends on the batch: one run per rank's tokens
        outs = [_run(ref, x[a:b], g[a:b], None) for a, b in
                ((sum(T_r[:s]), sum(T_r[:s + 1])) for s in range(world))]
        y_ref, gx_ref = outs[rank][0].y, outs[rank][1]
        pairs_ref = int(outs[rank][0].stats.pairs_computed)
    else:
        out_ref, gx_all = _run(ref, x, g, ids)
        y_ref, gx_ref = out_ref.y[lo:hi], gx_all[lo:hi]
        pairs_ref = (hi - lo) * case["K"]
    ep.zero_grad(set_to_none=True)
    seen: dict[str, torch.Tensor] = {}
    ep.experts.register_forward_pre_hook(lambda m, args: seen.update(offsets=args[0].offsets_E.clone()))
    out, gx = _run(ep, x[lo:hi], g[lo:hi], None if ids is None else ids[lo:hi])
    L = E // world
    # the destination groups hold exactly the valid pairs routed to each local expert by every rank
    # (invalid slots get no row), each padded to the dispatcher's alignment
    counts_E = out.stats.tokens_per_expert_E.clone()
    dist.all_reduce(counts_E)
    align = ep.dispatcher.align
    local_E = counts_E[rank * L:(rank + 1) * L]
    res_offsets = (seen["offsets"], torch.cumsum((local_E + align - 1) // align * align, 0))
    res = dict(y=(out.y, y_ref), x=(gx, gx_ref))
    for name, p in ep.named_parameters():
        p_ref = dict(ref.named_parameters())[name]
        if name.startswith("experts."):
            res[name] = (p.grad, p_ref.grad[rank * L:(rank + 1) * L])
        else:  # replicated: the data-parallel sum over ranks
            dist.all_reduce(p.grad)
            res[name] = (p.grad, p_ref.grad)
    res["_stats"] = out.stats
    res["_offsets"] = res_offsets
    res["_pairs_ref"] = pairs_ref
    return res


def _check_parity(tag: str, res: dict, tol: tuple[float, float]) -> None:
    """Every float result at the fp32 noise floor (tolerances.EP_REDUCED says why not bit-exact)."""
    for name, pair in res.items():
        if name.startswith("_"):
            continue
        got, want = pair
        assert_close(got, want, tol, msg=f"{tag} {name}")


def _check_comm(rank: int, world: int) -> None:
    # variable splits: rank r sends r+i+1 rows to rank i; backward returns each gradient to its row
    send = [rank + i + 1 for i in range(world)]
    recv = [j + rank + 1 for j in range(world)]
    x = torch.arange(sum(send), dtype=torch.float32).add(100 * rank).requires_grad_(True)
    y = comm.all_to_all(x[:, None], recv, send, None)
    assert y.shape[0] == sum(recv)
    starts = [sum(send[:i]) for i in range(world)]
    for j in range(world):  # block from rank j holds rank j's rows destined to us
        blk = y[sum(recv[:j]):sum(recv[:j + 1]), 0]
        first = sum(j + i + 1 for i in range(rank))
        assert torch.equal(blk, torch.arange(first, first + recv[j], dtype=torch.float32) + 100 * j)
    (y[:, 0] * y[:, 0].detach()).sum().backward()  # d/dx = x, routed back to where it came from
    assert torch.equal(x.grad, x.detach()), starts
    z = comm.all_to_all_fixed(torch.full((2 * world, 3), float(rank)), None)
    assert torch.equal(z[:, 0], torch.arange(world).repeat_interleave(2).float())
    # zero_row: one zero row appended to the output; its gradient is dropped on the way back
    x2 = x.detach().clone().requires_grad_(True)
    y2 = comm.all_to_all(x2[:, None], recv, send, None, zero_row=True)
    assert y2.shape[0] == sum(recv) + 1 and torch.equal(y2[-1], torch.zeros(1))
    assert torch.equal(y2[:-1], y.detach())
    (y2[:, 0] * torch.arange(y2.shape[0], dtype=torch.float32)).sum().backward()
    assert torch.equal(x2.grad, comm.all_to_all(torch.arange(sum(recv), dtype=torch.float32)[:, None],
                                                send, recv, None)[:, 0])
    z2 = comm.all_to_all_fixed(torch.full((2 * world, 3), float(rank)), None, zero_row=True)
    assert z2.shape == (2 * world + 1, 3) and torch.equal(z2[-1], torch.zeros(3))


def _check_bound(rank: int, world: int) -> None:
    """Buffered mode refuses, on the host and before any collective, a rank over the shared bound,
    and refuses to be built without one."""
    torch.manual_seed(0)
    layer = MoELayer(8, MoEConfig(num_experts=8, top_k=2, d_expert=6))
    with pytest.raises(ValueError, match="max_tokens"):
        shard_moe_layer(copy.deepcopy(layer), None, ParallelConfig(ep_size=world, ep_mode="buffered"))
    ep = shard_moe_layer(layer, None, ParallelConfig(ep_size=world, ep_mode="buffered", max_tokens_per_rank=4))
    with pytest.raises(ValueError, match="5 tokens on EP rank .* max_tokens=4"):
        ep(torch.randn(5, 8))  # every rank over the bound: all raise, none waits in a collective
    dist.barrier()  # and the group still works


def _check_contract(rank: int, world: int) -> None:
    """The dispatcher contract on its own: typed metadata with this rank's expert slice, each row's
    routing weight handed to the experts (invalid slots: no row), and combine an unweighted sum."""
    E, K, T, D = 2 * world, 3, 7, 4
    L = E // world
    gen = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    valid = torch.rand(T, K, generator=gen) < 0.7
    dec = RoutingDecision(ids, w * valid, torch.zeros(T, E), torch.zeros(T, E), valid)
    for mode in ("exact", "buffered"):
        for dedup in (False, True):
            disp = EPDispatcher(E, None, align=2, mode=mode, dedup=dedup, max_tokens=T)
            batch, meta = disp.dispatch(torch.randn(T, D, generator=gen), dec)
            assert isinstance(meta, DispatchMeta)
            assert (meta.first_expert, meta.num_local) == (rank * L, L)
            # the weights of the valid pairs every rank routes to this rank's experts
            want_P = torch.stack([(w * valid * ((ids // L) == r)).sum() for r in range(world)])
            dist.all_reduce(want_P)
            assert_close(batch.weights_R.sum(), want_P[rank], EP_REDUCED, msg=f"{mode} dedup={dedup} weights_R")
            # ones in every row, padding included: each token gets its number of valid pairs
            y = disp.combine(torch.ones(batch.x_RD.shape[0], D), meta)
            assert torch.equal(y, valid.sum(1, keepdim=True).float().expand(T, D)), f"{mode} dedup={dedup}"


def _worker(rank: int, world: int) -> None:
    # new tensors NaN-filled: a read of memory nobody wrote (GEMM tails, padding, empty slots) would
    # reach an output or gradient as NaN and fail the comparison
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    _check_comm(rank, world)
    _check_bound(rank, world)
    _check_contract(rank, world)
    for case in _case_list(world):
        for mode, dedup in MODES:
            # buffered: "tight" sizes each link to the busiest link's load, so no pair drops but most
            # links have empty slots; all-on-rank0 uses -1 (the worst case), which never overflows
            factor = -1 if case.get("force") else "tight"
            tag = f"world={world} {case['name']} {mode} dedup={dedup}"
            res = _run_case(rank, world, case, mode, dedup, factor)
            _check_parity(tag, res, EP_LOWP if case.get("precision") else EP_REDUCED)
            st = res["_stats"]
            assert int(st.pairs_dropped) == 0, tag
            assert int(st.pairs_computed) == res["_pairs_ref"], tag
            got, want = res["_offsets"]
            assert torch.equal(got.long(), want), f"{tag} offsets {got.tolist()} != {want.tolist()}"
        if case.get("force") == "rank0":
            for dedup in (False, True):  # small buffers: overflow is counted, never silent
                tag = f"world={world} overflow dedup={dedup}"
                res = _run_case(rank, world, case, "buffered", dedup, 0.5)
                st = res["_stats"]
                assert int(st.pairs_dropped) > 0, tag
                assert int(st.pairs_computed) + int(st.pairs_dropped) == case["T"][rank] * case["K"], tag
                assert bool(must_invalidate(st.pairs_dropped)), tag
                for name, pair in res.items():  # dropped pairs contribute zeros, never NaN
                    if not name.startswith("_"):
                        assert torch.isfinite(pair[0]).all(), f"{tag} {name}"
    # E not divisible by the EP size
    if world == 4:
        with pytest.raises(ValueError, match="num_experts=6.*ep_size=4"):
            EPDispatcher(6, None)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ep_matches_single_process(world: int, tmp_path: Path) -> None:
    run_world(_worker, world, tmp_path)


def test_e_not_divisible_raises() -> None:
    with pytest.raises(ValueError, match="num_experts=10.*ep_size=4"):
        local_expert_count(10, 4)
    assert local_expert_count(64, 4) == 16
