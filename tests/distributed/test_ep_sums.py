"""The EP dispatcher's de-dup sums (`_BagSum`: one embedding_bag over rows grouped by target) against a
plain per-row loop: outputs, gradients of the rows and of the weights, left-out rows holding NaN."""

from __future__ import annotations

import pytest
import torch

from dropless.distributed.ep import _bags, _BagSum
from tolerances import REFERENCE, assert_close


def _reference(y_ND: torch.Tensor, w_N: torch.Tensor | None, seg_N: torch.Tensor, S: int) -> torch.Tensor:
    # fp32 products and sums in row order, one rounding; weights rounded to y's dtype first, as the
    # fast path does
    out = torch.zeros(S, y_ND.shape[1])
    for n in range(y_ND.shape[0]):
        s = int(seg_N[n])
        if s < S:
            w = 1.0 if w_N is None else w_N[n].to(y_ND.dtype).float()
            out[s] = out[s] + w * y_ND[n].float()
    return out.to(y_ND.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("N,S", [(23, 7), (5, 9), (0, 3), (4, 0)])  # empty segments, no rows, no segments
def test_bag_sum_matches_loop(dtype, weighted, N, S) -> None:
    gen = torch.Generator().manual_seed(N * 31 + S)
    D = 6
    seg = torch.randint(0, S + 1, (N,), generator=gen)  # S = left out
    y = torch.randn(N, D, generator=gen).to(dtype)
    y[seg == S] = float("nan")  # left-out rows may be uninitialised GEMM output
    w = torch.rand(N, generator=gen) if weighted else None
    g = torch.randn(S, D, generator=gen).to(dtype)

    def run(fn):
        yl = y.clone().requires_grad_(True)
        wl = None if w is None else w.clone().requires_grad_(True)
        out = fn(yl, wl)
        if out.requires_grad:  # the loop over no rows builds no graph
            (out.float() * g.float()).sum().backward()
        return out.detach(), yl.grad, None if wl is None else wl.grad

    fast = run(lambda yl, wl: _BagSum.apply(yl, wl, seg, _bags(seg, S), S))
    ref = run(lambda yl, wl: _reference(yl, wl, seg, S))
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
    if weighted:
        assert torch.equal(fast[2][~keep], torch.zeros_like(fast[2][~keep]))
        # dw[n] = sum_d g[seg[n], d] * y[n, d], a sum with cancellation: bounded by its terms (tolerances.py)
        dw_terms = (g.float()[seg[keep]] * y[keep].float()).abs().sum(-1)
        assert_close(fast[2][keep], ref[2][keep], tol, msg="dw", terms=dw_terms)


def test_bag_sum_sums_in_row_order_bit_exactly() -> None:
    # fp32, no weights: each segment adds its rows in row order, as the loop does, so the bits agree.
    # (With weights the fast path may fuse multiply and add, one rounding instead of two: within
    # REFERENCE, not bit-equal.) The source side's per-token sum over ranks is this unweighted case.
    gen = torch.Generator().manual_seed(0)
    seg = torch.randint(0, 5, (40,), generator=gen)
    y = torch.randn(40, 8, generator=gen)
    assert torch.equal(_BagSum.apply(y, None, seg, _bags(seg, 4), 4), _reference(y, None, seg, 4))
