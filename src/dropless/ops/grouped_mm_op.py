"""torch's grouped_mm as a custom op, for tracing at any dtype (torch.compile of an fp32 run).

torch's shape rule for `_grouped_mm` (the meta function dynamo runs while tracing) accepts bf16
operands only (torch 2.13), while its CPU kernel computes fp32 too. `dropless::grouped_mm` calls the
same kernel on the same operands (so the same bits as eager), and gives the tracer its own shape rule;
inductor calls it as an opaque kernel. ops/grouped_gemm.py routes a call here only while compiling
with operands that are not bf16: eager calls and bf16 graphs keep torch's op (inductor knows it, and
on CUDA can lower it to its own kernels).

The two layouts dropless uses (ops/grouped_gemm.py):
    a [M, K]   b [G, K, N]  offs [G] on the rows of a   -> [M, N]     (forward, dgrad)
    a [K, M]   b [M, N]     offs [G] on the shared M    -> [G, K, N]  (wgrad)
Autograd (for the plain, non-lean path) is derivatives.yaml's for `_grouped_mm` in the first layout:
    da = grouped_mm(g, b^T), db = grouped_mm(a^T, g); the wgrad layout is only called inside backward
passes and is not differentiated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_native = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@torch.library.custom_op("dropless::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if _native is None:
        raise RuntimeError("this torch has no grouped_mm; use backend='loop' or torch >= 2.9")
    return _native(a, b, offs=offs)


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if a.dim() == 2 and b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    if a.dim() == 2 and b.dim() == 2:
        return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])
    raise RuntimeError(f"dropless::grouped_mm: layouts {a.dim()}d x {b.dim()}d are not used here")


def _setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, g: torch.Tensor):
    a, b, offs = ctx.saved_tensors
    if b.dim() != 3:
        raise RuntimeError("dropless::grouped_mm: the wgrad layout is not differentiated")
    g = g.contiguous()
    da = grouped_mm(g, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    db = grouped_mm(a.transpose(-2, -1), g, offs) if ctx.needs_input_grad[1] else None
    return da, db, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


def traced(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped_mm, through the custom op when a compile traces non-bf16 operands (module note)."""
    if torch.compiler.is_compiling() and a.dtype != torch.bfloat16:
        return grouped_mm(a, b, offs)
    return _native(a, b, offs=offs)
