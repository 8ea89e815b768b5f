"""The fused RMSNorm (ops/rms_norm.py) against its plain-PyTorch reference: the output bit for bit
(the forward runs the reference's own ops), every gradient at the reference tolerance (the closed-form
backward sums in another order)."""

from __future__ import annotations

import pytest
import torch

from dropless.layers.norm import RMSNorm
from dropless.ops.rms_norm import rms_norm, rms_norm_reference
from tolerances import REFERENCE, assert_close


def run(fn, x, w, g, eps=1e-6):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = fn(x, w, eps)
    y.backward(g)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    (3, 17, 32),  # the model's [B, S, D] residual stream
    (5, 7),  # an odd width: the vectorised reductions' scalar tails
    (2, 3, 4, 16),  # [B, S, H, Dh]: the per-head q/k norm (Qwen3)
    (1, 1),  # D = 1: x_hat is the sign of x, the gradient into x is zero
    (0, 8),  # no rows (an empty micro-batch on this rank)
])
def test_rms_norm_matches_reference(dtype, shape) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    w = 1 + 0.5 * torch.randn(shape[-1], generator=gen)  # fp32 gain, away from 1
    g = torch.randn(shape, generator=gen).to(dtype)
    fast, ref = run(rms_norm, x, w, g), run(rms_norm_reference, x, w, g)
    assert torch.equal(fast[0], ref[0])  # the same ops in the same order
    # dx = r (g w - x_hat mean(g w x_hat)) and dw = sum_T g x_hat cancel: their rounding follows
    # the magnitude of the terms they sum (tolerances.py)
    xf, gf = x.float(), g.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    xhat, gw = xf * r, gf * w
    dx_terms = r * (gw.abs() + xhat.abs() * (gw * xhat).abs().mean(-1, keepdim=True))
    dw_terms = (gf * xhat).abs().reshape(-1, shape[-1]).sum(0)
    assert_close(fast[1], ref[1], REFERENCE[dtype], "dx", terms=dx_terms)
    assert_close(fast[2], ref[2], REFERENCE[torch.float32], "dw", terms=dw_terms)


def test_module_under_autocast_matches_reference() -> None:
    """The model's use: an fp32 residual stream under CPU bf16 autocast (the norm stays fp32)."""
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(24)
    with torch.no_grad():
        norm.weight.mul_(1 + 0.3 * torch.randn(24, generator=gen))
    x = torch.randn(4, 9, 24, generator=gen)
    g = torch.randn(4, 9, 24, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = run(lambda x, w, eps: norm(x), x, norm.weight, g)
        ref = run(rms_norm_reference, x, norm.weight, g)
    assert fast[0].dtype == torch.float32
    assert torch.equal(fast[0], ref[0])
    assert_close(fast[1], ref[1], REFERENCE[torch.float32], "dx", terms=torch.ones(()) * 4)
    # the module's own weight gradient (run() differentiates a copy of it for the reference)
    norm.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norm(x).backward(g)
    assert_close(norm.weight.grad, ref[2], REFERENCE[torch.float32], "dw", terms=torch.ones(()) * 40)


def test_weight_frozen_or_input_constant() -> None:
    """Only the gradients asked for are computed, and each alone matches."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 10, generator=gen), 1 + torch.rand(10, generator=gen)
    xr = x.clone().requires_grad_(True)
    rms_norm(xr, w, 1e-5).sum().backward()
    xe = x.clone().requires_grad_(True)
    rms_norm_reference(xe, w, 1e-5).sum().backward()
    assert_close(xr.grad, xe.grad, REFERENCE[torch.float32], "dx", terms=torch.ones(()) * 2)
    wr = w.clone().requires_grad_(True)
    rms_norm(x, wr, 1e-5).sum().backward()
    we = w.clone().requires_grad_(True)
    rms_norm_reference(x, we, 1e-5).sum().backward()
    assert_close(wr.grad, we.grad, REFERENCE[torch.float32], "dw", terms=torch.ones(()) * 20)
