"""The EP dispatcher against the single-process MoE layer, on gloo worlds of 2 and 4 processes.

Every worker builds the same reference layer (same seed), runs it on the whole global batch, then
shards a copy with `shard_moe_layer` and runs its own slice of the batch through expert parallelism.
Compared: the output slice, the input gradient slice, the local experts' weight gradients against the
matching slice of the reference's, and the router and shared-expert gradients summed over ranks (the
data-parallel reduction a trainer would do). One spawn per world size runs every case, because
starting interpreters is what costs time here.
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
from dropless.distributed.ep import EPDispatcher, local_expert_count, must_invalidate
from dropless.distributed.parallelize_ep import shard_moe_layer
from dropless.layers.moe import MoELayer
from tolerances import EP_REDUCED, assert_close

MODES = [(mode, dedup) for mode in ("exact", "buffered") for dedup in (False, True)]


def _case_list(world: int) -> list[dict]:
    return [
        # router-chosen routing, k=3 over E=8: tokens often pick two experts on one rank (de-dup path)
        dict(name="router", T=[6] * world, E=8, K=3),
        # alignment padding inside every destination group, and shared experts (replicated weights)
        dict(name="align_shared", T=[5] * world, E=8, K=2, align=4, n_shared_experts=1, d_shared=4),
        # every token on rank 0's experts: the other ranks receive nothing and compute empty groups
        dict(name="all_on_rank0", T=[6] * world, E=2 * world, K=2, force="rank0"),
        # one rank has no tokens at all (sends nothing); exact mode only (buffered assumes equal T)
        dict(name="empty_sender", T=[0] + [5] * (world - 1), E=8, K=2, exact_only=True),
        # ... and still runs its shared experts on zero rows
        dict(name="empty_sender_shared", T=[0] + [5] * (world - 1), E=8, K=2, exact_only=True,
             n_shared_experts=1, d_shared=4),
        # k = E with one expert per rank: every token goes to every rank; padded groups
        dict(name="kE_one_expert_per_rank", T=[5] * world, E=world, K=world, align=4),
        # the ranks that receive nothing still hold padded (empty) groups
        dict(name="all_on_rank0_align", T=[6] * world, E=2 * world, K=2, force="rank0", align=4),
    ]


def _run_case(rank: int, world: int, case: dict, mode: str, dedup: bool, factor: float | str) -> dict:
    T_r, E, K = case["T"], case["E"], case["K"]
    d, f = 8, 6
    cfg = MoEConfig(num_experts=E, top_k=K, d_expert=f, align=case.get("align", 1),
                    n_shared_experts=case.get("n_shared_experts", 0), d_shared=case.get("d_shared", 0),
                    router=RouterConfig())
    torch.manual_seed(0)
    ref = MoELayer(d, cfg)
    # The EP dispatcher applies the combine weights at the source after the return trip; the local
    # default folds them into the activation instead ((w * h) @ W rounds differently from w * (h @ W)).
    # Compare against the local path that weights at combine, as EP does.
    ref.dispatcher.fold_weights = False
    gen = torch.Generator().manual_seed(1)
    T = sum(T_r)
    x = torch.randn(T, d, generator=gen)
    g = torch.randn(T, d, generator=gen)
    ids = None
    if case.get("force") == "rank0":
        L = E // world
        ids = torch.stack([torch.randperm(L, generator=gen)[:K] for _ in range(T)])
    lo, hi = sum(T_r[:rank]), sum(T_r[:rank + 1])
    if factor == "tight" and mode == "buffered":
        with torch.no_grad():
            ids_all = ref.router(x).ids_TK if ids is None else ids
        src = torch.repeat_interleave(torch.arange(world), torch.tensor(T_r))
        link = src[:, None] * world + ids_all // (E // world)  # (source, destination) of each pair
        busiest = int(torch.bincount(link.reshape(-1), minlength=world * world).max())
        factor = busiest * world / (T_r[0] * K)
    elif factor == "tight":
        factor = 2.0  # unused in exact mode

    def run(layer: MoELayer, xs: torch.Tensor, gs: torch.Tensor, ids_s: torch.Tensor | None):
        xs = xs.detach().clone().requires_grad_(True)
        out = layer(xs, replay_ids=ids_s)
        (out.y * gs).sum().backward()
        return out, xs.grad

    out_ref, gx_ref = run(ref, x, g, ids)
    ep = shard_moe_layer(copy.deepcopy(ref), None, ParallelConfig(
        ep_size=world, ep_mode=mode, dedup=dedup, ragged_buffer_factor=factor))
    ep.zero_grad(set_to_none=True)
    out, gx = run(ep, x[lo:hi], g[lo:hi], None if ids is None else ids[lo:hi])
    L = E // world
    res = dict(y=(out.y, out_ref.y[lo:hi]), x=(gx, gx_ref[lo:hi]))
    for name, p in ep.named_parameters():
        p_ref = dict(ref.named_parameters())[name]
        if name.startswith("experts."):
            res[name] = (p.grad, p_ref.grad[rank * L:(rank + 1) * L])
        else:  # replicated: the data-parallel sum over ranks
            dist.all_reduce(p.grad)
            res[name] = (p.grad, p_ref.grad)
    res["_stats"] = out.stats
    return res


def _check_parity(tag: str, res: dict) -> None:
    """Every float result at the fp32 noise floor (tolerances.EP_REDUCED says why not bit-exact)."""
    for name, pair in res.items():
        if name.startswith("_"):
            continue
        got, want = pair
        assert_close(got, want, EP_REDUCED, msg=f"{tag} {name}")


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


def _worker(rank: int, world: int) -> None:
    # new tensors NaN-filled: a read of memory nobody wrote (GEMM tails, padding, empty slots) would
    # reach an output or gradient as NaN and fail the comparison
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    _check_comm(rank, world)
    for case in _case_list(world):
        for mode, dedup in MODES:
            if mode == "buffered" and case.get("exact_only"):
                continue
            # buffered: "tight" sizes each link to the busiest link's load, so no pair drops but most
            # links have empty slots; all-on-rank0 uses -1 (the worst case), which never overflows
            factor = -1 if case.get("force") else "tight"
            tag = f"world={world} {case['name']} {mode} dedup={dedup}"
            res = _run_case(rank, world, case, mode, dedup, factor)
            _check_parity(tag, res)
            st = res["_stats"]
            assert int(st.pairs_dropped) == 0, tag
            assert int(st.pairs_computed) == case["T"][rank] * case["K"], tag
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


@pytest.mark.parametrize("world", [2, 4])
def test_ep_matches_single_process(world: int, tmp_path: Path) -> None:
    run_world(_worker, world, tmp_path)


def test_e_not_divisible_raises() -> None:
    with pytest.raises(ValueError, match="num_experts=10.*ep_size=4"):
        local_expert_count(10, 4)
    assert local_expert_count(64, 4) == 16
