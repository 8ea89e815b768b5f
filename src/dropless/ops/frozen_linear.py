"""A linear map by a frozen weight stored narrower than its input: y = x W^T + b in x's dtype.

Legend: I input width, O output width; x [..., I], w [O, I] (frozen, e.g. bf16), b [O] or None.

A frozen LoRA base held in bf16 (train.lora.base, layers/frozen_base.py) in a run that computes in
fp32 without autocast: `F.linear(x, w.to(x.dtype), b)` would be the plain way, but autograd keeps
the fp32 copy of w for the input's gradient, 4 bytes per weight per layer until the backward, more
than the stored weight itself. This Function keeps the stored weight (a reference: no bytes) and
casts it again in the backward, dx = dy W. The weight and bias get no gradient (frozen). Same
products as the plain way: the forward is that call, the backward the matmul autograd runs for it.
Under autocast none of this applies (autocast's bf16 copy of a bf16 weight is the weight itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _FrozenLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(w)
        return frozen_linear_reference(x, w, b)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (w,) = ctx.saved_tensors
        return dy.matmul(w.to(dy.dtype)), None, None


def applies(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether a linear map needs this: a frozen weight (and bias) in another dtype than x, no autocast."""
    return (w.dtype != x.dtype and not w.requires_grad and (b is None or not b.requires_grad)
            and not torch.is_autocast_enabled(x.device.type))


def frozen_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """y = x w^T + b in x's dtype, keeping only the stored (frozen) w for the backward (module note)."""
    if w.requires_grad or (b is not None and b.requires_grad):
        raise ValueError("frozen_linear: the weight and bias must be frozen (requires_grad=False)")
    return _FrozenLinear.apply(x, w, b)


def frozen_linear_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The plain composition (autograd keeps the cast copy of w)."""
    return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))
