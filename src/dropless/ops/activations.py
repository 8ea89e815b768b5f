"""Gated and plain activations on the prefused gate|up product.

Legend: R routed rows, F expert hidden width. `h_R2F` holds [gate | up] side by side, the output of
one GEMM against w_gate_up (so the input rows are read once, not twice).

Clamps: `clamp` is a hard clamp of the gate and up pre-activations to [-c, c] (c = 10 in DeepSeek-V4
style models; it bounds the largest activation, which matters for low-precision GEMMs whose scales
follow the block maximum). `softcap` is a smooth alternative, c * tanh(x / c), with a gradient that
never becomes exactly zero. Both are optional; clamp wins when both are set.

`weighted_swiglu` is the fast path of the experts' SwiGLU (no clamp, no softcap): one autograd node
that optionally multiplies row r by a routing weight w_R[r] (the "memory-efficient permutation" of
mission.md section 4: the combine weight is folded into the activation, so combine keeps no T*K x D
tensor for its backward). It saves h_R2F, silu(gate) and w_R (silu is not recomputed: the [R, F]
it keeps costs less than the extra silu pass, measured on the CPU; the lean experts, ops/lean_experts.py,
make the other trade and recompute it from h in their backward), and writes the gate and up gradients straight into one [R, 2F]
buffer (autograd's chunk would concatenate them: one more full pass). `weighted_swiglu_reference` is its specification.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _cap(x: torch.Tensor, clamp: float | None, softcap: float | None) -> torch.Tensor:
    if clamp is not None:
        return x.clamp(-clamp, clamp)
    if softcap is not None:
        return softcap * torch.tanh(x / softcap)
    return x


def is_gated(kind: str) -> bool:
    return kind in ("swiglu", "geglu")


def activation(h: torch.Tensor, kind: str, clamp: float | None = None,
               softcap: float | None = None) -> torch.Tensor:
    """Apply `kind` to the last dimension: [.., 2F] -> [.., F] for gated kinds, [.., F] -> [.., F] else."""
    if kind == "relu2":
        return F.relu(_cap(h, clamp, softcap)).square()
    gate, up = h.chunk(2, dim=-1)
    gate, up = _cap(gate, clamp, softcap), _cap(up, clamp, softcap)
    if kind == "swiglu":
        return F.silu(gate) * up
    if kind == "geglu":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"activation={kind!r}: must be one of swiglu, geglu, relu2")


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`, without the call when `t` has that dtype already (a no-op op on every device,
    but still one dispatched op per call)."""
    return t if t.dtype == dtype else t.to(dtype)


def weighted_swiglu_reference(h_R2F: torch.Tensor, w_R: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up, times w_R[r] on row r when given (w_R cast to h's dtype)."""
    out = activation(h_R2F, "swiglu")
    return out if w_R is None else out * w_R.to(out.dtype).unsqueeze(-1)


class _WeightedSwiGLU(torch.autograd.Function):
    # gate and up stay strided column halves of h. torch's CPU silu is faster on contiguous rows
    # (vectorised), but its vectorised body and scalar tail round the last ulp differently, so a
    # row's result would depend on where it sits in the tensor; on the strided halves every element
    # takes the same path, which keeps expert-parallel results bit-identical to one device (the EP
    # dispatcher runs the same rows in differently sized buffers). Measured cost: a few ms per layer.
    @staticmethod
    def forward(ctx, h_R2F: torch.Tensor, w_R: torch.Tensor | None) -> torch.Tensor:
        out, s_RF = swiglu_forward(h_R2F, w_R)  # s kept: recomputing it cost a full silu pass
        ctx.save_for_backward(h_R2F, s_RF, w_R)
        ctx.w_dtype = None if w_R is None else w_R.dtype
        return out

    @staticmethod
    def backward(ctx, grad_RF: torch.Tensor):
        h_R2F, s, w_R = ctx.saved_tensors
        return swiglu_backward(grad_RF, h_R2F, s, w_R, ctx.needs_input_grad[1], ctx.w_dtype)


def swiglu_forward(h_R2F: torch.Tensor, w_R: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up * w_R[r], silu(gate)): the fused SwiGLU's forward, shared by `_WeightedSwiGLU`
    and the lean experts (ops/lean_experts.py), which call it again in their backward to recompute
    the activation from h: the same ops on the same strided halves, so the same bits."""
    gate, up = h_R2F.chunk(2, dim=-1)
    s_RF = F.silu(gate)
    out = s_RF * up
    if w_R is not None:
        out.mul_(as_dtype(w_R, out.dtype).unsqueeze(-1))
    return out, s_RF


def swiglu_backward(grad_RF: torch.Tensor, h_R2F: torch.Tensor, s: torch.Tensor, w_R: torch.Tensor | None,
                    want_grad_w: bool, w_dtype: torch.dtype | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad of h_R2F, grad of w_R or None) of `swiglu_forward`, given s = silu(gate)."""
    gate, up = h_R2F.chunk(2, dim=-1)
    if torch.compiler.is_compiling():
        return _swiglu_backward_functional(grad_RF, gate, up, s, w_R, want_grad_w, w_dtype)
    F_ = gate.shape[-1]
    grad_h = grad_RF.new_empty(gate.shape[0], 2 * F_)
    g_up = grad_RF * up
    grad_w = None
    if w_R is None:
        torch.mul(grad_RF, s, out=grad_h[:, F_:])
    else:
        w_R1 = as_dtype(w_R, grad_RF.dtype).unsqueeze(-1)
        torch.mul(grad_RF * s, w_R1, out=grad_h[:, F_:])
        if want_grad_w:
            # sum_f grad * up * silu(gate), a row-wise dot product: vecdot is one fused pass
            # (a [R,1,F] x [R,F,1] bmm gives the same bits but was 10x slower on CPU)
            grad_w = as_dtype(torch.linalg.vecdot(g_up, s), w_dtype)
        g_up.mul_(w_R1)
    # written straight into the gate half: no [R, F] temporary and no copy
    torch.ops.aten.silu_backward.grad_input(g_up, gate, grad_input=grad_h[:, :F_])
    return grad_h, grad_w


def _swiglu_backward_functional(grad_RF: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, s: torch.Tensor,
                                w_R: torch.Tensor | None, want_grad_w: bool, w_dtype: torch.dtype | None
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_WeightedSwiGLU.backward` without its `out=` writes into the halves of one buffer, which
    torch.compile cannot trace (a graph break): the same element-wise ops in the same order, so the
    same values; the halves are concatenated, a copy the compiler can fuse away."""
    g_up = grad_RF * up
    if w_R is None:
        return torch.cat([torch.ops.aten.silu_backward(g_up, gate), grad_RF * s], dim=-1), None
    w_R1 = w_R.to(grad_RF.dtype).unsqueeze(-1)
    grad_w = torch.linalg.vecdot(g_up, s).to(w_dtype) if want_grad_w else None
    g_up = g_up * w_R1
    return torch.cat([torch.ops.aten.silu_backward(g_up, gate), (grad_RF * s) * w_R1], dim=-1), grad_w


def weighted_swiglu(h_R2F: torch.Tensor, w_R: torch.Tensor | None = None) -> torch.Tensor:
    """Fast path of `weighted_swiglu_reference` for 2-d [R, 2F] inputs."""
    return _WeightedSwiGLU.apply(h_R2F, w_R)
