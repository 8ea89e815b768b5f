"""RMSNorm as one autograd Function: the forward's own ops, a hand-written backward.

Legend: T rows (all leading dims), D normalised width.
    x_TD     input (fp32 residual stream, or bf16/fp16 activations)
    r_T1     1 / sqrt(mean_d(x^2) + eps), fp32
    xhat_TD  x * r, fp32 (what the weight multiplies)
    w_D      gain

Why: the plain composition (`rms_norm_reference`) is five element-wise ops whose autograd graph runs
about twelve passes over [T, D] in the backward (pow, mean, rsqrt, two broadcast multiplies, each
with its own backward and a broadcast reduction); in the default CPU training step the norms were
about a tenth of the step (docs/training_speed.md, "Where a CPU training step goes"). This Function runs
the forward's ops as they are (same ops, same order: the same bits as the reference) and keeps xhat
and r; its backward is the closed form

    g' = g * w;   dx = r * (g' - xhat * mean_d(g' * xhat));   dw = sum_T(g * xhat)

in six passes, all in fp32 (as the reference's backward runs: its graph is fp32 from `x.float()`
on). The gradients differ from autograd's by the order of the operations, i.e. a few fp32 ulps
(tests/ops/test_rms_norm.py compares outputs with torch.equal and gradients at the fp32 tolerance).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .autocast import autocast_available


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain composition: normalise in fp32 (the mean of squares of bf16 activations loses the
    small ones), multiply by the gain, back to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        r_T1 = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        xhat_TD = xf * r_T1
        ctx.save_for_backward(xhat_TD, r_T1, weight)
        ctx.x_dtype = x.dtype
        return (xhat_TD * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        xhat_TD, r_T1, weight = ctx.saved_tensors
        gf = g.float()
        dw = None
        if ctx.needs_input_grad[1]:
            D = xhat_TD.shape[-1]
            dw = (gf * xhat_TD).reshape(-1, D).sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            gw_TD = gf * weight.float()
            # fp32 whatever autocast says (a backward run inside an autocast region would otherwise
            # take the dot product in bf16)
            dev = gw_TD.device.type
            with torch.autocast(dev, enabled=False) if autocast_available(dev) else nullcontext():
                dot_T1 = torch.linalg.vecdot(gw_TD, xhat_TD).unsqueeze(-1)
            dx = gw_TD.sub_(xhat_TD * dot_T1.div_(xhat_TD.shape[-1])).mul_(r_T1).to(ctx.x_dtype)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference(x, weight, eps)` with the closed-form backward (module note)."""
    return _RMSNorm.apply(x, weight, eps)
