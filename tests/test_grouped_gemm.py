"""Grouped GEMM backends against the per-expert loop: outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from dropless.ops import grouped_gemm as G
from tolerances import REFERENCE, assert_close


def run(fn, x, w, offs):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = fn(x, w, offs)
    n = int(offs[-1])
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(0), dtype=y.dtype)
    (y[:n] * g[:n]).sum().backward()  # rows past the last group are never read
    return y[:n].detach(), x.grad[:n], w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts,D,F", [
    ([5, 0, 7, 3], 16, 8),  # an empty expert in the middle
    ([0, 0, 12, 0], 16, 8),  # every row on one expert
    ([3, 1, 4, 1, 5, 9, 2], 13, 7),  # prime E, odd widths (padded to 16-byte strides)
    ([1], 8, 8),  # one expert, one row
])
def test_grouped_mm_matches_loop(dtype, counts, D, F) -> None:
    g = torch.Generator().manual_seed(1)
    R = sum(counts) + 3  # trailing rows past the last group, as the aligned plan leaves them
    x = torch.randn(R, D, generator=g).to(dtype)
    w = torch.randn(len(counts), D, F, generator=g).to(dtype)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    fast = run(G.grouped_mm, x, w, offs)
    ref = run(G.grouped_mm_reference, x, w, offs)
    for a, b, name in zip(fast, ref, ("y", "dx", "dw")):
        assert_close(a.float(), b.float(), tol=REFERENCE[dtype], msg=name)


def test_padded_bmm_equals_grouped_over_equal_groups() -> None:
    x, w = torch.randn(12, 8), torch.randn(3, 8, 4)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    assert_close(G.padded_bmm(x, w, 4), G.grouped_mm_reference(x, w, offs))


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts,D,F", [
    ([5, 0, 7, 3], 16, 8),  # an empty expert in the middle
    ([0, 0, 12, 0], 16, 8),  # every row on one expert
    ([3, 1, 4, 1, 5, 9, 2], 13, 7),  # prime E, odd widths: the backward pads as the forward did
])
def test_dgrad_wgrad_equal_autograd(backend, dtype, counts, D, F) -> None:
    """The explicit backward products (for Functions that own their backward, ops/lean_experts.py)
    are the bits autograd computes for the forward: the same kernels on the same operands."""
    g = torch.Generator().manual_seed(1)
    R = sum(counts) + 3
    x = torch.randn(R, D, generator=g).to(dtype).requires_grad_(True)
    w = torch.randn(len(counts), D, F, generator=g).to(dtype).requires_grad_(True)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    fwd = G.grouped_mm if backend == "grouped_mm" else G.grouped_mm_reference
    y = fwd(x, w, offs)
    n = int(offs[-1])
    dy = torch.randn(y.shape, generator=g).to(dtype)
    dy[n:] = 0  # rows past the last group carry no gradient (nothing reads them)
    y.backward(dy)
    assert torch.equal(G.grouped_dgrad(dy, w.detach(), offs, backend)[:n], x.grad[:n])
    assert torch.equal(G.grouped_wgrad(x.detach(), dy, offs, backend), w.grad)
