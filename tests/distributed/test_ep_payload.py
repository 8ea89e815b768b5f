"""The low-precision dispatch payload (parallel.dispatch_dtype) on gloo worlds of 2 and 4 processes.

The reference is the one-process layer with the same setting: its local dispatcher rounds the rows
as the wire would carry them (layers/dispatch.py `LocalDispatcher.payload`). Compared:
- the rows each EP rank's experts receive, bit for bit, against the reference's rows for the same
  experts (the payload is encoded once per row at the source, decoded at the destination: the same
  numbers as rounding locally);
- the layer's output and parameter gradients at the EP floor (tolerances.EP_LOWP / EP_REDUCED), for
  mxfp8 rows into mxfp8 experts and fp8 blockwise rows (an odd width: a short last block) into
  full-precision experts, in every mode (exact, buffered, de-dup on and off), with shared experts
  computed while the rows are in flight and without, and through the spill trip;
- the input gradient within the bf16 wire's rounding (it travels back in bf16);
- mxfp8 rows into full-precision experts against the native payload: within the MXFP8 error floor;
- the same through the ring dispatch (ep_ring.py), which gathers the encoded rows.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_world
from dropless.config import MoEConfig, ParallelConfig
from dropless.distributed import comm
from dropless.distributed.parallelize_ep import shard_moe_layer
from dropless.layers.moe import MoELayer
from dropless.ops import payload
from tolerances import EP_GRAD_WIRE_BF16, EP_LOWP, EP_REDUCED, assert_close, lowp_layer_rel_err

MODES = [(mode, dedup) for mode in ("exact", "buffered") for dedup in (False, True)]


def _cases(world: int) -> list[dict]:
    T = [20, 9, 14, 3][:world]
    return [
        # mxfp8 rows into mxfp8 experts; dyadic inputs keep the router's weights the same bits (EP_LOWP)
        dict(name="mxfp8_into_mxfp8", payload="mxfp8", precision="mxfp8", d=32, f=32, T=T, dyadic=True),
        dict(name="mxfp8_into_mxfp8_shared", payload="mxfp8", precision="mxfp8", d=32, f=32, T=T, dyadic=True,
             shared=True),
        # fp8 blockwise rows of width 130: one 128 block and a short one of 2
        dict(name="fp8_blockwise_odd_width", payload="fp8_blockwise", precision="bf16", d=130, f=8, T=T),
        dict(name="bf16_rows", payload="bf16", precision="bf16", d=8, f=8, T=T, shared=True),
    ]


def _layer(case: dict, world: int) -> MoELayer:
    torch.manual_seed(0)
    shared = dict(n_shared_experts=1, d_shared=4) if case.get("shared") else {}
    return MoELayer(case["d"], MoEConfig(num_experts=2 * world, top_k=2, d_expert=case["f"],
                                         precision=case["precision"], **shared))


def _inputs(case: dict, layer: MoELayer) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    T, d = sum(case["T"]), case["d"]
    if case.get("dyadic"):  # x in k/8, router weights in k/16: every logit is exact in any order
        x = torch.randint(-8, 9, (T, d), generator=gen).float() / 8
        with torch.no_grad():
            layer.router.weight.copy_(torch.randint(-4, 5, layer.router.weight.shape, generator=gen).float() / 16)
    else:
        x = torch.randn(T, d, generator=gen) * torch.logspace(-1, 1, T)[:, None]
    return x, torch.randn(T, d, generator=gen)


def _run(layer: MoELayer, x: torch.Tensor, g: torch.Tensor) -> tuple[object, torch.Tensor, dict]:
    seen: dict = {}
    hook = layer.experts.register_forward_pre_hook(
        lambda m, args: seen.update(x=args[0].x_RD.detach().clone(), ends=args[0].offsets_E.long().clone()))
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    (out.y * g).sum().backward()
    hook.remove()
    return out, x.grad, seen


def _group_rows(seen: dict, counts: list[int]) -> list[torch.Tensor]:
    """Each group's real rows (its padding cut off)."""
    starts = [0] + seen["ends"].tolist()[:-1]
    return [seen["x"][s:s + n] for s, n in zip(starts, counts)]


def _check_case(rank: int, world: int, case: dict, mode: str, dedup: bool, on_overflow: str = "retry",
                factor: float = -1, ep_dispatch: str = "all_to_all") -> None:
    tag = f"world={world} {case['name']} {mode} dedup={dedup} {on_overflow} {ep_dispatch}"
    base = _layer(case, world)
    x, g = _inputs(case, base)
    T_r = case["T"]
    lo, hi = sum(T_r[:rank]), sum(T_r[:rank + 1])
    ref = copy.deepcopy(base)
    ref.dispatcher = replace(ref.dispatcher, payload=case["payload"])
    out_ref, gx_ref, seen_ref = _run(ref, x, g)
    ep = shard_moe_layer(copy.deepcopy(base), None, ParallelConfig(
        ep_size=world, ep_mode=mode, dedup=dedup, ragged_buffer_factor=factor, max_tokens_per_rank=max(T_r),
        on_overflow=on_overflow, dispatch_dtype=case["payload"], ep_dispatch=ep_dispatch))
    out, gx, seen = _run(ep, x[lo:hi], g[lo:hi])
    L = ep.dispatcher.num_local
    counts = out_ref.stats.tokens_per_expert_E.tolist()
    # the rows this rank's experts received: the reference's rows for the same experts, bit for bit
    got = _group_rows(seen, counts[rank * L:(rank + 1) * L])
    want = _group_rows(seen_ref, counts)[rank * L:(rank + 1) * L]
    for e, (a, b) in enumerate(zip(got, want)):
        if on_overflow == "spill":  # the spilled pairs join their group after the first trip's: same rows
            a, b = (torch.unique(t, dim=0, return_counts=True) for t in (a, b))
            assert all(torch.equal(u, v) for u, v in zip(a, b)), f"{tag}: expert {rank * L + e}'s rows"
        else:
            assert torch.equal(a, b), f"{tag}: expert {rank * L + e}'s rows differ from local rounding"
    tol = EP_LOWP if case["precision"] != "bf16" else EP_REDUCED
    assert_close(out.y, out_ref.y[lo:hi], tol, msg=f"{tag} y")
    # the input gradient came back over a bf16 wire: each pair's row rounded once
    gmax = float(gx_ref.abs().max())
    assert_close(gx, gx_ref[lo:hi], (EP_GRAD_WIRE_BF16, EP_GRAD_WIRE_BF16 * gmax), msg=f"{tag} x.grad")
    for name, p in ep.named_parameters():
        p_ref = dict(ref.named_parameters())[name]
        if name.startswith("experts."):
            assert_close(p.grad, p_ref.grad[rank * L:(rank + 1) * L], tol, msg=f"{tag} {name}")
        else:  # replicated: summed over ranks; the router's gradient does not cross the wire
            dist.all_reduce(p.grad)
            big = max(1.0, float(p_ref.grad.abs().max()))
            # the router's: the EP floor relative to the largest entry, as EP_REDUCED's reason states it
            # (rows spanning 1e-2..1e2 make its token sums cancel; a sum of fp32-noisy terms is off by
            # a few ulps of the largest term, not of the result)
            assert_close(p.grad, p_ref.grad, (tol[0], tol[1] * big) if name.startswith("router") else
                         (EP_GRAD_WIRE_BF16, EP_GRAD_WIRE_BF16 * big), msg=f"{tag} {name}")
    if on_overflow == "spill":
        spilled = out.stats.pairs_spilled.clone()
        dist.all_reduce(spilled)
        assert int(out.stats.pairs_dropped) == 0 and int(spilled) > 0, tag


def _check_wire(rank: int, world: int) -> None:
    """The rows arrive decoded as `payload.fake` gives them; the gradient goes back in bf16."""
    gen = torch.Generator().manual_seed(10 + rank)
    x = (torch.randn(2 * world, 64, generator=gen) * 3).requires_grad_(True)
    for pl in ("mxfp8", "fp8_blockwise", "bf16"):
        for start in (False, True):
            if start:
                y = comm.all_to_all_wait(comm.all_to_all_start(x, None, None, None, zero_row=True, payload=pl))
            else:
                y = comm.all_to_all_fixed(x, None, zero_row=True, payload=pl)
            want = torch.cat(_gather_blocks(payload.fake(x.detach(), pl), world))
            assert torch.equal(y[:-1], want), (pl, start)
            assert torch.equal(y[-1], torch.zeros(64)), (pl, start)
            gy = torch.randn(y.shape, generator=gen)
            x.grad = None
            y.backward(gy)
            back = comm.all_to_all_fixed(gy[:-1].to(torch.bfloat16).float(), None)
            assert torch.equal(x.grad, back), (pl, start)


def _gather_blocks(rows: torch.Tensor, world: int) -> list[torch.Tensor]:
    """What all_to_all_fixed delivers: block r of every rank's rows, in rank order."""
    out = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(out, rows)
    n = rows.shape[0] // world
    me = dist.get_rank()
    return [o[me * n:(me + 1) * n] for o in out]


def _against_native(rank: int, world: int) -> None:
    """mxfp8 rows into full-precision experts: within the MXFP8 floor of the native payload."""
    case = dict(name="vs_native", payload="mxfp8", precision="bf16", d=64, f=32, T=[24] * world)
    base = _layer(case, world)
    x, g = _inputs(case, base)
    lo, hi = 24 * rank, 24 * (rank + 1)
    res = {}
    for pl in ("native", "mxfp8"):
        ep = shard_moe_layer(copy.deepcopy(base), None, ParallelConfig(ep_size=world, dispatch_dtype=pl))
        out, gx, _ = _run(ep, x[lo:hi], g[lo:hi])
        res[pl] = (out.y.detach(), gx)
    for i, what in enumerate(("y", "x.grad")):
        a, b = res["mxfp8"][i], res["native"][i]
        rel = float((a - b).norm() / b.norm())
        assert 0 < rel <= lowp_layer_rel_err("mxfp8"), f"{what}: relative error {rel}"


def _worker(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    _check_wire(rank, world)
    for case in _cases(world):
        for mode, dedup in MODES:
            _check_case(rank, world, case, mode, dedup)
        for mode in ("exact", "buffered"):  # the ring gathers the encoded rows
            _check_case(rank, world, case, mode, True, ep_dispatch="ring")
    # buffered links too small for the load: the pairs that did not fit take the exact second trip
    spill = dict(_cases(world)[0], name="mxfp8_spill")
    for dedup in (False, True):
        _check_case(rank, world, spill, "buffered", dedup, on_overflow="spill", factor=0.5)
    _against_native(rank, world)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_payload_matches_local_rounding(world: int, tmp_path: Path) -> None:
    run_world(_worker, world, tmp_path)


def test_dispatch_dtype_refused() -> None:
    with pytest.raises(ValueError, match="parallel.dispatch_dtype='fp4'"):
        ParallelConfig(dispatch_dtype="fp4")
