"""The EP dispatcher's sums (`BagSum`: one embedding_bag over rows grouped by target) against a plain
per-row loop: outputs and row gradients, left-out rows holding NaN, and fixed-size bags of K slots
over a shared zero row (the source-side sum without de-dup)."""

from __future__ import annotations

import pytest
import torch

from dropless.distributed.ep_plan import BagSum, bags
from tolerances import REFERENCE, assert_close


def _reference(y_ND: torch.Tensor, seg_N: torch.Tensor, S: int) -> torch.Tensor:
    # fp32 sums in row order, one rounding, as the fast path does
    out = torch.zeros(S, y_ND.shape[1])
    for n in range(y_ND.shape[0]):
        s = int(seg_N[n])
        if s < S:
            out[s] = out[s] + y_ND[n].float()
    return out.to(y_ND.dtype)


def _run(fn, y: torch.Tensor, g: torch.Tensor):
    yl = y.clone().requires_grad_(True)
    out = fn(yl)
    if out.requires_grad:  # the loop over no rows builds no graph
        (out.float() * g.float()).sum().backward()
    return out.detach(), yl.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,S", [(23, 7), (5, 9), (0, 3), (4, 0)])  # empty segments, no rows, no segments
def test_bag_sum_matches_loop(dtype, N, S) -> None:
    gen = torch.Generator().manual_seed(N * 31 + S)
    D = 6
    seg = torch.randint(0, S + 1, (N,), generator=gen)  # S = left out
    y = torch.randn(N, D, generator=gen).to(dtype)
    y[seg == S] = float("nan")  # left-out rows may be uninitialised GEMM output
    g = torch.randn(S, D, generator=gen).to(dtype)
    fast = _run(lambda yl: BagSum.apply(yl, seg, bags(seg, S), S), y, g)
    ref = _run(lambda yl: _reference(yl, seg, S), y, g)
    tol = REFERENCE[dtype]
    assert torch.isfinite(fast[0]).all()
    assert_close(fast[0], ref[0], tol, msg="out")
    if N == 0 or S == 0:  # nothing summed: the fast path's row gradients (if any) are zeros
        assert fast[1] is None or not fast[1].any()
        return
    # the reference's gradient into a left-out NaN row is 0 * NaN; the fast path's is a clean 0
    keep = seg < S
    assert torch.equal(fast[1][~keep], torch.zeros_like(fast[1][~keep]))
    assert_close(fast[1][keep], ref[1][keep], tol, msg="dy")


def test_bag_sum_fixed_bags_over_a_zero_row() -> None:
    # T tokens of K slots; each slot reads its own row or the shared zero row N (a pair not sent).
    # The sum is in slot order and the gradient of row n goes to its token: a gather.
    gen = torch.Generator().manual_seed(3)
    T, K, N, D = 5, 3, 9, 4
    idx = torch.where(torch.rand(T * K, generator=gen) < 0.3, N, torch.randperm(T * K, generator=gen) % N)
    seg = torch.full((N + 1,), T)
    for p in range(T * K):  # every real row belongs to at most one slot
        if idx[p] < N:
            if seg[idx[p]] < T:
                idx[p] = N
            else:
                seg[idx[p]] = p // K
    y = torch.randn(N + 1, D, generator=gen)
    y[N] = 0.0
    y[:N][seg[:N] == T] = float("nan")  # rows nobody reads
    g = torch.randn(T, D, generator=gen)
    fast = _run(lambda yl: BagSum.apply(yl, seg, (idx, torch.arange(T + 1) * K), T), y, g)
    want = torch.stack([sum((y[i] for i in idx[t * K:(t + 1) * K]), torch.zeros(D)) for t in range(T)])
    assert torch.equal(fast[0], want)  # same order of additions, fp32
    grad_want = torch.cat([g, torch.zeros(1, D)])[seg]
    assert torch.equal(fast[1], grad_want)


def test_bag_sum_sums_in_row_order_bit_exactly() -> None:
    # fp32: each segment adds its rows in row order, as the loop does, so the bits agree. The source
    # side's per-token sum over ranks is this case.
    gen = torch.Generator().manual_seed(0)
    seg = torch.randint(0, 5, (40,), generator=gen)
    y = torch.randn(40, 8, generator=gen)
    assert torch.equal(BagSum.apply(y, seg, bags(seg, 4), 4), _reference(y, seg, 4))
