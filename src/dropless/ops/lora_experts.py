"""Routed-expert LoRA on the grouped path: the adapters ride the same offsets, no update is ever formed.

Legend: T tokens, R routed rows in expert order, E experts, D model width, F expert width, W the
gate|up width (2F gated, F otherwise), r the adapter rank, s = alpha / r.
    w1_EDW, w2_EFD     the frozen base (never differentiated: frozen)
    a1_EDr, b1_ErW     gate|up's adapter;  a2_EFr, b2_ErD  down's adapter
    u1_Rr = x @ a1,  h_RW = x @ w1 + (u1 @ b1) * s        (per group, on the batch's offsets)
    act_RF = act(h) * w_R  (the routing weight folded in, as layers/experts.py)
    u2_Rr = act @ a2,  y_RD = act @ w2 + (u2 @ b2) * s

Why a Function and not autograd over the composition: autograd would keep x_RD, h, the activation,
silu(gate) and act ([R, D], [R, W], [R, F] each) for the backward, as the plain expert path does
(ops/lean_experts.py). This one keeps what the lean experts keep (h, the routing weights, the
indices and a reference to the token rows) plus the two [R, r] products u1 and u2, and in the
backward
    g2 = dy * s;  db2 = u2^T g2;  du2 = g2 @ b2^T;  d_act = dy @ w2^T + du2 @ a2^T
    the activation recomputed from h and its backward (dh, d w_R), as the lean experts do
    da2 = act^T du2;  g1 = dh * s;  db1 = u1^T g1;  du1 = g1 @ b1^T
    x re-gathered from the token rows;  da1 = x^T du1;  dx = dh @ w1^T + du1 @ a1^T
Every weight gradient is a grouped wgrad onto an adapter ([E, D, r], [E, r, W], ...): no [E, D, W]
product, gradient or temporary exists, forward or backward (tests/ops/test_lora_experts.py counts the
tensors made). The base's gradient is never computed: it is frozen. These are the products autograd
runs for `lora_experts_reference` on the same backend, in the same order.

A frozen base stored narrow (QLoRA: train.lora.base, layers/frozen_base.py) is passed as `dequant`, a callable
that returns (w1, w2) in the compute dtype: called once in the forward and once in the backward, so
the dequantised weights live only while a GEMM needs them and are never kept between the passes
(they are the one [E, D, W] temporary of that mode: the base itself, never an update).
"""

from __future__ import annotations

from typing import Callable

import torch

from . import grouped_gemm
from .lean_experts import BACKENDS, RowSource, _act, _fused, _gemm, _swiglu_recompute_backward, regather
from .activations import swiglu_forward, weighted_swiglu

Dequant = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def _activate(h_RW: torch.Tensor, w_R: torch.Tensor | None, kind: str, clamp: float | None,
              softcap: float | None) -> torch.Tensor:
    if _fused(kind, clamp, softcap):
        return swiglu_forward(h_RW, w_R)[0]
    return _act(h_RW, w_R, kind, clamp, softcap)


class _LoRAExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, x_TD, src_R, padded, w1, w2, dequant, a1, b1, a2, b2, scale, offsets_E, w_R,
                kind, clamp, softcap, backend):
        if dequant is not None:
            w1, w2 = dequant()
        u1 = _gemm(x_RD, a1, offsets_E, backend)
        h_RW = _gemm(x_RD, w1, offsets_E, backend) + _gemm(u1, b1, offsets_E, backend) * scale
        act = _activate(h_RW, w_R, kind, clamp, softcap)
        u2 = _gemm(act, a2, offsets_E, backend)
        y_RD = _gemm(act, w2, offsets_E, backend) + _gemm(u2, b2, offsets_E, backend) * scale
        keep_w = (None, None) if dequant is not None else (w1, w2)
        ctx.save_for_backward(x_RD if x_TD is None else x_TD, src_R, *keep_w, a1, b1, a2, b2, offsets_E,
                              h_RW, u1, u2, w_R)
        ctx.spec = (kind, clamp, softcap, backend, padded, x_RD.dtype, scale, dequant)
        ctx.w_dtype = None if w_R is None else w_R.dtype
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        x_saved, src_R, w1, w2, a1, b1, a2, b2, offsets_E, h_RW, u1, u2, w_R = ctx.saved_tensors
        kind, clamp, softcap, backend, padded, x_dtype, scale, dequant = ctx.spec
        need = ctx.needs_input_grad
        need_x, need_a1, need_b1, need_a2, need_b2, need_wr = need[0], need[7], need[8], need[9], need[10], need[13]
        if dequant is not None:
            w1, w2 = dequant()
        dy_RD = dy_RD.contiguous()  # grouped_mm refuses an expanded gradient (grouped_gemm.py)
        g2 = dy_RD * scale
        db2 = grouped_gemm.grouped_wgrad(u2, g2, offsets_E, backend) if need_b2 else None
        du2 = grouped_gemm.grouped_dgrad(g2, b2, offsets_E, backend)
        del g2
        d_act = grouped_gemm.grouped_dgrad(dy_RD, w2, offsets_E, backend) \
            + grouped_gemm.grouped_dgrad(du2, a2, offsets_E, backend)
        if _fused(kind, clamp, softcap):
            act, dh_RW, dw_R = _swiglu_recompute_backward(h_RW, w_R, d_act, need_wr, ctx.w_dtype)
        else:
            with torch.enable_grad():
                h_ = h_RW.detach().requires_grad_(True)
                wr_ = None if w_R is None else w_R.detach().requires_grad_(need_wr)
                act_ = _act(h_, wr_, kind, clamp, softcap)
            inputs = [h_] + ([wr_] if wr_ is not None and need_wr else [])
            grads = torch.autograd.grad(act_, inputs, d_act)
            act, dh_RW = act_.detach(), grads[0]
            dw_R = grads[1] if len(grads) > 1 else None
        del d_act
        da2 = grouped_gemm.grouped_wgrad(act, du2, offsets_E, backend) if need_a2 else None
        del act, du2
        g1 = dh_RW * scale
        db1 = grouped_gemm.grouped_wgrad(u1, g1, offsets_E, backend) if need_b1 else None
        du1 = grouped_gemm.grouped_dgrad(g1, b1, offsets_E, backend)
        del g1
        da1 = None
        if need_a1:
            x_RD = x_saved if src_R is None else regather(RowSource(x_saved, src_R, padded), x_dtype)
            da1 = grouped_gemm.grouped_wgrad(x_RD, du1, offsets_E, backend)
            del x_RD
        dx_RD = None
        if need_x:
            dx_RD = grouped_gemm.grouped_dgrad(dh_RW, w1, offsets_E, backend) \
                + grouped_gemm.grouped_dgrad(du1, a1, offsets_E, backend)
        return (dx_RD, None, None, None, None, None, None, da1, db1, da2, db2, None, None, dw_R,
                None, None, None, None)


def lora_experts(x_RD: torch.Tensor, w1_EDW: torch.Tensor | None, w2_EFD: torch.Tensor | None,
                 adapters: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], scale: float,
                 offsets_E: torch.Tensor, w_R: torch.Tensor | None = None, source: RowSource | None = None,
                 kind: str = "swiglu", clamp: float | None = None, softcap: float | None = None,
                 backend: str = "grouped_mm", dequant: Dequant | None = None) -> torch.Tensor:
    """y_RD of the adapted expert MLP (module note). `adapters` = (a1, b1, a2, b2); the base is
    (w1, w2), or `dequant()` when stored packed (then w1 = w2 = None); `source` says how to re-gather
    the rows in the backward (None: x_RD itself is kept)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: the LoRA experts run on {', '.join(BACKENDS)}")
    if (dequant is None) == (w1_EDW is None):
        raise ValueError("lora_experts: give the base weights or `dequant`, not both")
    a1, b1, a2, b2 = adapters
    x_TD, src_R, padded = (None, None, False) if source is None else (source.x_TD, source.src_R, source.padded)
    return _LoRAExperts.apply(x_RD, x_TD, src_R, padded, w1_EDW, w2_EFD, dequant, a1, b1, a2, b2, scale,
                              offsets_E, w_R, kind, clamp, softcap, backend)


def lora_experts_reference(x_RD: torch.Tensor, w1_EDW: torch.Tensor, w2_EFD: torch.Tensor,
                           adapters: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                           scale: float, offsets_E: torch.Tensor, w_R: torch.Tensor | None = None,
                           kind: str = "swiglu", clamp: float | None = None, softcap: float | None = None,
                           gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                           ) -> torch.Tensor:
    """The plain composition (autograd keeps every intermediate): the executable specification, and
    the path of the capacity layout (`gemm` = its padded bmm). Default `gemm`: the per-expert loop."""
    mm = gemm or (lambda x, w: grouped_gemm.grouped_mm_reference(x, w, offsets_E))
    a1, b1, a2, b2 = adapters
    h_RW = mm(x_RD, w1_EDW) + mm(mm(x_RD, a1), b1) * scale
    act = weighted_swiglu(h_RW, w_R) if _fused(kind, clamp, softcap) else _act(h_RW, w_R, kind, clamp, softcap)
    return mm(act, w2_EFD) + mm(mm(act, a2), b2) * scale
