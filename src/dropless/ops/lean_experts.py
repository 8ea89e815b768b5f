"""Lean routed experts: the expert MLP as one autograd Function that keeps no [R, D] or [R, F] tensor.

Legend: T tokens, R routed rows in expert order (R ~ T*K), E experts, D model width, F expert width
(W = 2F for gated activations, F otherwise).
    x_TD       the tokens' rows (the layer's input: the caller keeps it anyway)
    src_R      token of each row, T = the zero padding row (`RoutingPlan.src_R`)
    x_RD       the rows in expert order, x_RD[r] = x_TD[src_R[r]]
    h_RW       pre-activation, x_RD @ w1 per group ([gate | up] for SwiGLU)
    a_RF       weighted activation, act(h_RW) * w_R[r] (the routing weight folded in, layers/dispatch.py)
    y_RD       the rows' outputs, a_RF @ w2 per group (not yet summed per token)

What the autograd graph of the plain composition (`lean_experts_reference`, i.e. grouped GEMM ->
weighted activation -> grouped GEMM with autograd recording each op) keeps for the backward: x_RD
(GEMM 1's input, T*K*D), h (the activation's input), silu(gate) (the fused SwiGLU keeps it), a
(GEMM 2's input): at medium bf16 about 48 KB per token of the 56 KB the layer kept. This Function
keeps h, the routing weights, the indices and a reference to x_TD (the floor of the fastest
published MoE kernels: input and pre-activation), and in the backward
    da = dy @ W2^T per group;
    recomputes the activation from h (silu and two multiplies, the forward's own ops on the same
    strided halves: the same bits) and runs the activation's backward (dh, and dw_R, the row dot
    product <da * up, silu(gate)>: it needs no expert output) in one pass over blocks of rows, so
    silu(gate) never exists whole and each block is read from memory about once
    (`_swiglu_recompute_backward`; this pass is most of what the recompute costs);
    dW2 = grouped wgrad(a, dy);
    re-gathers x_RD from x_TD by src_R (a gather: cheap beside the GEMMs);
    dW1 = grouped wgrad(x_RD, dh);  dx_RD = dh @ W1^T per group.
dx_RD is returned as the gradient of the forward's x_RD, so the dispatcher's permute backward sums
it into dx_TD as before (a fixed-order gather-sum, no scatter-add). The products are those torch's
autograd runs for the plain composition on the same operands (ops/grouped_gemm.py
`grouped_dgrad`/`grouped_wgrad`), so on a backend where the forward kernels are the same the
outputs and every gradient are the same bits as the reference (tests/test_lean_experts.py).

Without a `RowSource` (expert parallelism: the rows arrive from an all-to-all and no token rows of
this rank hold them) the Function keeps x_RD itself, the received buffer, and still drops the
activation. Activations other than plain SwiGLU (geglu, relu2, clamp, softcap) recompute theirs
under `torch.enable_grad()` in the backward and differentiate it with autograd: the forward's ops
again, so the same values. Backends: "grouped_mm" and "loop"; the capacity layout (padded_bmm) and
the low-precision recipes keep the plain composition (layers/experts.py).

A frozen base held narrow (train.lora.base, layers/frozen_base.py) comes as `dequant`, a zero-arg
callable returning (w1, w2) in the compute dtype, with w1 = w2 = None: called in the forward and
again in the backward, so the dequantised weights are never kept between them (as in
ops/lora_experts.py); a frozen base has no weight gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import grouped_gemm
from .activations import activation, as_dtype, swiglu_backward, swiglu_forward, weighted_swiglu

BACKENDS = ("grouped_mm", "loop")


@dataclass(frozen=True)
class RowSource:
    """Where a batch's rows come from, so the experts can re-gather them in the backward:
    x_RD[r] = x_TD[src_R[r]], where src_R[r] = T reads a zero row when `padded` (padding rows)."""

    x_TD: torch.Tensor
    src_R: torch.Tensor
    padded: bool


def _gemm(x_RD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor, backend: str,
          group_rows: int | None = None) -> torch.Tensor:
    if backend == "grouped_mm":
        return grouped_gemm.grouped_mm(x_RD, w_EDF, offsets_E, group_rows)
    return grouped_gemm.grouped_mm_reference(x_RD, w_EDF, offsets_E)


def _fused(kind: str, clamp: float | None, softcap: float | None) -> bool:
    return kind == "swiglu" and clamp is None and softcap is None


def _act(h_RW: torch.Tensor, w_R: torch.Tensor | None, kind: str, clamp: float | None,
         softcap: float | None) -> torch.Tensor:
    """The weighted activation of the unfused kinds: the ops of layers/experts.py's plain path."""
    a_RF = activation(h_RW, kind, clamp, softcap)
    return a_RF if w_R is None else a_RF * as_dtype(w_R, a_RF.dtype).unsqueeze(-1)


# at::internal::GRAIN_SIZE: an element-wise op over this many elements or fewer runs on one thread
_GRAIN = 32768
# the CPU's blocked recompute (`_swiglu_recompute_backward`); `bench layer --count-ops` turns it off to
# count the ops a GPU runs (the same bits either way)
CPU_BLOCKS = True


def _row_aligned(n_rows: int, width: int) -> bool:
    """Whether torch's intra-op split of an element-wise op over [n_rows, width] (at::parallel_for:
    min(threads, ceil(n / grain)) tasks of ceil(n / tasks) elements) falls on row boundaries. Only then
    does every row run from its first column, so a row's vectorised body and scalar tail (which round
    silu's last bit differently) are the same as in a row-by-row recompute."""
    n = n_rows * width
    tasks = min(torch.get_num_threads(), -(-n // _GRAIN))
    return tasks <= 1 or (-(-n // tasks)) % width == 0


def _swiglu_recompute_backward(h_RW: torch.Tensor, w_R: torch.Tensor | None, da_RF: torch.Tensor,
                               want_grad_w: bool, w_dtype: torch.dtype | None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(a_RF, dh_RW, dw_R): `swiglu_forward(h_RW, w_R)` recomputed and `swiglu_backward` with it, in
    blocks of rows, so silu(gate) lives only one block at a time in cache: the recompute's passes and
    the backward's read each block from memory about once instead of once per op, and no [R, F]
    silu(gate) is allocated (a_RF stays whole: dW2 needs it). The same ops on the same strided
    halves in the same order per element, each row from its first column as the whole-tensor calls
    ran it (`_row_aligned`; a block is one grain per thread, so torch splits it on grain, hence
    row, boundaries): the same bits.
    Otherwise (a split inside a row) the whole-tensor functions themselves."""
    R, F_ = h_RW.shape[0], h_RW.shape[1] // 2
    rows = max(1, _GRAIN // max(F_, 1))  # rows of one grain: one thread's share of a block
    # The blocks are a CPU cache optimisation: on a GPU each block would be ~9 kernel launches (R / rows
    # blocks: thousands at real widths), so every other device runs the whole-tensor functions.
    # is_compiling first: _row_aligned asks torch.get_num_threads(), which dynamo cannot trace.
    if (torch.compiler.is_compiling() or h_RW.device.type != "cpu" or not CPU_BLOCKS
            or R <= rows or not _row_aligned(R, F_)):
        a_RF, s_RF = swiglu_forward(h_RW, w_R)
        dh_RW, dw_R = swiglu_backward(da_RF, h_RW, s_RF, w_R, want_grad_w, w_dtype)
        return a_RF, dh_RW, dw_R
    a_RF = h_RW.new_empty(R, F_)
    dh_RW = da_RF.new_empty(R, 2 * F_)
    # the weight in a's dtype (swiglu_forward) and in the gradient's (swiglu_backward)
    wa_R1 = None if w_R is None else as_dtype(w_R, h_RW.dtype).unsqueeze(-1)
    wg_R1 = None if w_R is None else as_dtype(w_R, da_RF.dtype).unsqueeze(-1)
    want_w = w_R is not None and want_grad_w
    dw_R = h_RW.new_empty(R, dtype=torch.result_type(da_RF, h_RW)) if want_w else None
    # A block is one grain per thread (torch's split of it then falls on the block's grain boundaries,
    # which are row boundaries); the rows left over after the whole blocks go one grain at a time.
    whole = rows * max(1, torch.get_num_threads())
    cut = R - R % whole
    blocks = [(r, whole) for r in range(0, cut, whole)] + [(r, min(rows, R - r)) for r in range(cut, R, rows)]
    s = h_RW.new_empty(min(whole, R), F_)  # one block of silu(gate), reused
    for r, n in blocks:
        gate, up = h_RW[r:r + n].chunk(2, dim=-1)
        s_b, a, da = s[:n], a_RF[r:r + n], da_RF[r:r + n]
        torch.ops.aten.silu.out(gate, out=s_b)  # swiglu_forward, on this block
        torch.mul(s_b, up, out=a)
        g_up = da * up  # swiglu_backward, on this block
        if w_R is None:
            torch.mul(da, s_b, out=dh_RW[r:r + n, F_:])
        else:
            a.mul_(wa_R1[r:r + n])
            wg = wg_R1[r:r + n]
            torch.mul(da * s_b, wg, out=dh_RW[r:r + n, F_:])
            if dw_R is not None:
                torch.linalg.vecdot(g_up, s_b, out=dw_R[r:r + n])
            g_up.mul_(wg)
        torch.ops.aten.silu_backward.grad_input(g_up, gate, grad_input=dh_RW[r:r + n, :F_])
    return a_RF, dh_RW, None if dw_R is None else as_dtype(dw_R, w_dtype)


def regather(source: RowSource, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x_RD from its source: `permute.permute`'s forward (zero row appended when padded), in `dtype`
    (default the source's). Cast, then gathered: the same values as gathering then casting (a cast
    is element-wise and maps zero to zero), with T rows cast instead of R = T*K and the gather
    moving rows of the narrower dtype (bf16 autocast: half the bytes)."""
    x_TD = source.x_TD if dtype is None else as_dtype(source.x_TD, dtype)
    if source.padded:
        x_TD = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])
    return x_TD.index_select(0, source.src_R)


class _LeanExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, x_TD: torch.Tensor | None, src_R: torch.Tensor | None,
                padded: bool, w1_EDW: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor,
                w_R: torch.Tensor | None, kind: str, clamp: float | None, softcap: float | None,
                backend: str, dequant: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
                group_rows: int | None = None) -> torch.Tensor:
        if dequant is not None:
            w1_EDW, w2_EFD = dequant()
        h_RW = _gemm(x_RD, w1_EDW, offsets_E, backend, group_rows)
        if _fused(kind, clamp, softcap):
            a_RF, _ = swiglu_forward(h_RW, w_R)
        else:
            a_RF = _act(h_RW, w_R, kind, clamp, softcap)
        y_RD = _gemm(a_RF, w2_EFD, offsets_E, backend, group_rows)
        # x_TD (a reference to the caller's tensor) instead of the [R, D] rows when there is a source
        keep_w = (None, None) if dequant is not None else (w1_EDW, w2_EFD)
        ctx.save_for_backward(x_RD if x_TD is None else x_TD, src_R, *keep_w, offsets_E, h_RW, w_R)
        ctx.spec = (kind, clamp, softcap, backend, padded, x_RD.dtype, group_rows)
        ctx.dequant = dequant
        ctx.w_dtype = None if w_R is None else w_R.dtype
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD: torch.Tensor):
        x_saved, src_R, w1, w2, offsets_E, h_RW, w_R = ctx.saved_tensors
        kind, clamp, softcap, backend, padded, x_dtype, rows = ctx.spec
        need = ctx.needs_input_grad
        need_x, need_w1, need_w2, need_wr = need[0], need[4], need[5], need[7]
        if ctx.dequant is not None:
            w1, w2 = ctx.dequant()
        dy_RD = dy_RD.contiguous()  # grouped_mm refuses an expanded gradient (grouped_gemm.py)
        dw_R = None
        if _fused(kind, clamp, softcap):
            # da first (it does not need the activation), then the recompute and the SwiGLU backward
            # in one blocked pass, then dW2 from the recomputed activation: the same products
            da_RF = grouped_gemm.grouped_dgrad(dy_RD, w2, offsets_E, backend, rows)
            a_RF, dh_RW, dw_R = _swiglu_recompute_backward(h_RW, w_R, da_RF, need_wr, ctx.w_dtype)
            del da_RF
            dw2 = grouped_gemm.grouped_wgrad(a_RF, dy_RD, offsets_E, backend, rows) if need_w2 else None
            del a_RF
        else:
            with torch.enable_grad():
                h_ = h_RW.detach().requires_grad_(True)
                wr_ = None if w_R is None else w_R.detach().requires_grad_(need_wr)
                a_RF = _act(h_, wr_, kind, clamp, softcap)
            dw2 = grouped_gemm.grouped_wgrad(a_RF.detach(), dy_RD, offsets_E, backend, rows) if need_w2 else None
            da_RF = grouped_gemm.grouped_dgrad(dy_RD, w2, offsets_E, backend, rows)
            inputs = [h_] + ([wr_] if wr_ is not None and need_wr else [])
            grads = torch.autograd.grad(a_RF, inputs, da_RF)
            dh_RW = grads[0]
            dw_R = grads[1] if len(grads) > 1 else None
            del a_RF, h_, wr_, da_RF
        dw1 = None
        if need_w1:
            x_RD = x_saved if src_R is None else regather(RowSource(x_saved, src_R, padded), x_dtype)
            dw1 = grouped_gemm.grouped_wgrad(x_RD, dh_RW, offsets_E, backend, rows)
            del x_RD
        dx_RD = grouped_gemm.grouped_dgrad(dh_RW, w1, offsets_E, backend, rows) if need_x else None
        return dx_RD, None, None, None, dw1, dw2, None, dw_R, None, None, None, None, None, None


def lean_experts(x_RD: torch.Tensor, w1_EDW: torch.Tensor, w2_EFD: torch.Tensor, offsets_E: torch.Tensor,
                 w_R: torch.Tensor | None = None, source: RowSource | None = None, kind: str = "swiglu",
                 clamp: float | None = None, softcap: float | None = None,
                 backend: str = "grouped_mm",
                 dequant: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
                 group_rows: int | None = None) -> torch.Tensor:
    """y_RD = act(x_RD @ w1 per group) * w_R @ w2 per group, keeping only h (module note).

    `x_RD` carries the gradient (give the permuted rows, cast to the compute dtype); `source` says
    how to re-gather them in the backward (None: x_RD itself is kept). A frozen base stored narrow:
    `dequant`, with w1 = w2 = None (module note). `group_rows`: every group is that many rows (a
    uniform plan, ops/grouped_gemm.py `uniform_limit`): "grouped_mm" runs batched matmuls."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: the lean experts run on {', '.join(BACKENDS)}")
    if (dequant is None) == (w1_EDW is None):
        raise ValueError("lean_experts: give the base weights or `dequant`, not both")
    if source is None:
        return _LeanExperts.apply(x_RD, None, None, False, w1_EDW, w2_EFD, offsets_E, w_R, kind, clamp,
                                  softcap, backend, dequant, group_rows)
    return _LeanExperts.apply(x_RD, source.x_TD, source.src_R, source.padded, w1_EDW, w2_EFD, offsets_E,
                              w_R, kind, clamp, softcap, backend, dequant, group_rows)


def lean_experts_reference(x_RD: torch.Tensor, w1_EDW: torch.Tensor, w2_EFD: torch.Tensor,
                           offsets_E: torch.Tensor, w_R: torch.Tensor | None = None,
                           source: RowSource | None = None, kind: str = "swiglu",
                           clamp: float | None = None, softcap: float | None = None,
                           backend: str = "grouped_mm", group_rows: int | None = None) -> torch.Tensor:
    """The plain composition `lean_experts` replaces (autograd keeps every intermediate); `source`
    is ignored (the rows are the gradient path either way)."""
    h_RW = _gemm(x_RD, w1_EDW, offsets_E, backend, group_rows)
    if _fused(kind, clamp, softcap):
        a_RF = weighted_swiglu(h_RW, w_R)
    else:
        a_RF = _act(h_RW, w_R, kind, clamp, softcap)
    return _gemm(a_RF, w2_EFD, offsets_E, backend, group_rows)
