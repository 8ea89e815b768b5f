"""The fused weighted SwiGLU against its plain-PyTorch reference: output and every gradient."""

from __future__ import annotations

import pytest
import torch

from dropless.ops.activations import weighted_swiglu, weighted_swiglu_reference
from tolerances import REFERENCE, assert_close


def run(fn, h, w):
    h = h.detach().clone().requires_grad_(True)
    w = None if w is None else w.detach().clone().requires_grad_(True)
    y = fn(h, w)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y.dtype)
    (y * g).sum().backward()
    return y.detach(), h.grad, None if w is None else w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,F,weighted", [
    (37, 12, True),  # the experts' case: one combine weight per row
    (37, 12, False),  # no weights (a dispatcher that does not fold them)
    (5, 1, True),  # F=1: gate and up are single columns
    (0, 8, True),  # no rows at all (an empty micro-batch on this rank)
])
def test_weighted_swiglu_matches_reference(dtype, R, F, weighted) -> None:
    gen = torch.Generator().manual_seed(0)
    h = (2 * torch.randn(R, 2 * F, generator=gen)).to(dtype)
    w = torch.rand(R, generator=gen) if weighted else None  # fp32, as the router gives them
    if weighted and R:
        w[0] = 0.0  # a padding row: zero weight, zero gradient into h
    fast = run(weighted_swiglu, h, w)
    ref = run(weighted_swiglu_reference, h, w)
    for a, b, name in zip(fast, ref, ("y", "dh", "dw")):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype, name
        assert_close(a.float(), b.float(), tol=REFERENCE[dtype], msg=name)
    if weighted and R:
        assert torch.count_nonzero(fast[1][0]) == 0


def test_weighted_swiglu_is_deterministic() -> None:
    h, w = torch.randn(64, 16), torch.rand(64)
    a, b = run(weighted_swiglu, h, w), run(weighted_swiglu, h, w)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
