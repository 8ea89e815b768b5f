"""Routed experts with stacked weights and one backend seam for the grouped GEMM.

Legend: R routed rows (expert-major), E experts, D model width, F expert width.
    w_gate_up_EDF  (E, D, 2F) gate|up prefused (E, D, F for relu2): one read of the input rows
    w_down_EFD     (E, F, D)

The backend is chosen once at build: `grouped_mm` (the dropless path), `loop` (a per-expert loop:
the reference, syncs on the host), `padded_bmm` (the capacity layout: every expert holds C rows).
With `precision` other than "bf16" every expert GEMM goes through `ops.quant_gemm` instead (the
forward, dgrad and wgrad products quantised; emulated in fp32), whatever the backend.
Under CPU/GPU autocast the weights and rows are cast to the autocast dtype here, because torch's
autocast does not cover grouped_mm and would otherwise leave the expert GEMMs in fp32.

The routing weights are applied here, for every dispatcher (layers/dispatch.py says why): row r of
the activation is multiplied by the batch's weights_R[r] before the down GEMM, (w * h) @ W =
w * (h @ W). SwiGLU without clamp or softcap takes the fused `weighted_swiglu`. A batch without
weights (the experts called on their own) is unweighted.

Lean by default (`lean = True`, a plain attribute): with full precision on the grouped_mm or loop
backend the MLP runs as `ops.lean_experts` (one autograd Function that keeps only the
pre-activation h, the routing weights, the indices and a reference to the token rows; the rows are
re-gathered and the activation recomputed in the backward: docs/memory.md). That is what
`model.recompute = ["moe_act"]` names. `lean = False` is the keep-everything composition (x_RD,
h, silu(gate) and the activation kept), kept for comparison (`bench memory`'s
`dropless_keep_act`); the capacity layout (padded_bmm) and the low-precision recipes always take it.

A frozen base held narrow (train.lora.base, layers/frozen_base.py) sets `dequant_base`: the forward
passes w1 = w2 = None and `run_experts` asks `dequant_base(compute dtype)` for a callable that
returns the weights, which the lean and LoRA Functions call in the forward and again in the backward
(never keeping them); the plain composition (capacity layout, low-precision recipes, `lean = False`)
calls it once and autograd keeps what it returns.

`row_align` is the row alignment the GEMMs need from a dispatcher: the low-precision recipes quantise
the wgrad operands in blocks along tokens, so every expert group must be whole token blocks
(`quant_gemm.plan_align`); full precision needs none. The dispatchers take it via
`layers.dispatch.dispatch_align`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..ops import grouped_gemm, quant_gemm
from ..ops.activations import activation, is_gated, weighted_swiglu
from ..ops.autocast import autocast_available
from ..ops.lean_experts import BACKENDS as LEAN_BACKENDS
from ..ops.lean_experts import RowSource, lean_experts
from ..ops.lora_experts import Dequant, lora_experts, lora_experts_reference
from . import init, lora


@dataclass(frozen=True)
class ExpertBatch:
    """What a dispatcher hands the experts: rows in expert order and where each group ends."""

    x_RD: torch.Tensor
    offsets_E: torch.Tensor  # int32 group ends
    capacity: int | None = None  # rows per expert in the capacity layout
    weights_R: torch.Tensor | None = None  # routing weight per row (0 on padding); None = unweighted
    # how x_RD was gathered from the token rows (local dispatch): lets the lean experts re-gather
    # the rows in the backward instead of keeping them; None (expert parallel, direct calls): keep x_RD
    source: RowSource | None = None
    # (w_gate_up, w_down) -> the weights of the batch's groups, when they are more than the module's
    # own (hot-expert replicas, distributed/ep_hot_replicas.py: the copies fetched from their owners)
    grow: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    # the quant format x_RD's rows are already exact in along D (ops/payload.py `exact_format`: an
    # mxfp8 dispatch payload's decoded rows): a low-precision first GEMM in that format skips its
    # forward quantisation of them (ops/quant_gemm.py); None: no promise
    rows_format: str | None = None


def resolve_backend(backend: str, capacity_mode: bool) -> str:
    if backend == "auto":
        if capacity_mode:
            return "padded_bmm"
        return "grouped_mm" if grouped_gemm.has_grouped_mm() else "loop"
    return backend


class GroupedExperts(nn.Module):
    # a frozen base held narrow (layers/frozen_base.py): dtype -> Dequant; None: the parameters
    dequant_base: Callable[[torch.dtype], Dequant] | None = None

    def __init__(self, num_experts: int, d_model: int, d_expert: int, kind: str = "swiglu",
                 clamp: float | None = None, softcap: float | None = None, backend: str = "grouped_mm",
                 precision: str = "bf16") -> None:
        super().__init__()
        self.kind, self.clamp, self.softcap, self.backend = kind, clamp, softcap, backend
        self.precision = precision
        self.lean = True  # the lean Function where it applies (module note); False: keep everything
        self.row_align = quant_gemm.plan_align(precision, 1)  # 1, or the recipe's token block
        if precision != quant_gemm.FULL_PRECISION:
            quant_gemm.check_widths(precision, d_model, d_expert)
        width = 2 * d_expert if is_gated(kind) else d_expert
        self.w_gate_up_EDF = nn.Parameter(torch.empty(num_experts, d_model, width))
        self.w_down_EFD = nn.Parameter(torch.empty(num_experts, d_expert, d_model))
        self.reset_parameters()

    def init_rules(self) -> dict[str, init.Rule]:
        """N(0, 1/fan_in) for both stacks (layers/init.py); packed stacks (frozen_base.py) are buffers."""
        rules = lora.expert_adapter_rules(self)
        for name in ("w_gate_up_EDF", "w_down_EFD"):
            if name in self._parameters:
                rules[name] = init.normal(self._parameters[name].shape[1] ** -0.5)
        return rules

    def reset_parameters(self) -> None:
        init.apply_rules(self)

    def forward(self, batch: ExpertBatch) -> torch.Tensor:
        if self.dequant_base is not None:  # run_experts reads the frozen base through it
            if batch.grow is not None:
                raise ValueError("hot-expert replicas copy the experts' parameters; a frozen base held "
                                 "narrow has none to copy (train.lora.base with parallel.replicate_hot_experts)")
            return run_experts(self, batch.x_RD, None, None, batch)
        w_up, w_down = self.w_gate_up_EDF, self.w_down_EFD
        if batch.grow is not None:
            w_up, w_down = batch.grow(w_up, w_down)
        return run_experts(self, batch.x_RD, w_up, w_down, batch)


def expert_gemm(x_RD: torch.Tensor, w_EDF: torch.Tensor, batch: ExpertBatch, backend: str,
                precision: str, rows_format: str | None = None) -> torch.Tensor:
    """One grouped GEMM of the batch's rows by their experts' weights, on `backend` (module note).
    `rows_format`: the first GEMM's promise about its rows (ExpertBatch.rows_format)."""
    if precision != quant_gemm.FULL_PRECISION:
        return quant_gemm.quant_grouped_mm(x_RD, w_EDF, batch.offsets_E, precision, rows_format)
    if backend == "grouped_mm":  # uniform groups (a capacity or uniform plan): one batched matmul
        return grouped_gemm.grouped_mm(x_RD, w_EDF, batch.offsets_E, batch.capacity)
    if backend == "padded_bmm":
        if batch.capacity is None:
            raise ValueError("backend='padded_bmm' needs the capacity layout (capacity_factor set)")
        return grouped_gemm.padded_bmm(x_RD, w_EDF, batch.capacity)
    if backend == "loop":
        return grouped_gemm.grouped_mm_reference(x_RD, w_EDF, batch.offsets_E)
    raise ValueError(f"backend={backend!r}: must be grouped_mm, loop or padded_bmm")


def runs_lean(spec: GroupedExperts | nn.Module) -> bool:
    """Whether `run_experts` takes the lean Function for this module (module note). Under
    torch.compile only the fused SwiGLU does: the other activations' lean backward differentiates
    its recomputed activation with `torch.autograd.grad`, which dynamo does not trace (fullgraph
    would fail), so compiled they keep the plain path (same values, more bytes kept)."""
    if not (getattr(spec, "lean", True) and spec.precision == quant_gemm.FULL_PRECISION
            and spec.backend in LEAN_BACKENDS):
        return False
    fused = spec.kind == "swiglu" and spec.clamp is None and spec.softcap is None
    return fused or not torch.compiler.is_compiling()


def run_experts(spec: GroupedExperts | nn.Module, x_RD: torch.Tensor, w1_EDW: torch.Tensor | None,
                w2_EFD: torch.Tensor | None, batch: ExpertBatch) -> torch.Tensor:
    """The expert MLP over a batch: autocast cast, first GEMM, (weighted) activation, down GEMM.
    `spec` supplies kind, clamp, softcap, backend and precision (GroupedExperts, or PackedExperts with
    its dequantised weights and the batch cut to the experts that have rows). w1 = w2 = None: the
    frozen base comes from `spec.dequant_base` in the compute dtype (module note)."""
    dev = x_RD.device.type
    autocast = autocast_available(dev) and torch.is_autocast_enabled(dev)
    dequant = None
    if w1_EDW is None:  # the compute dtype: autocast's, else the rows' (a bf16 base in an fp32 run: fp32)
        if autocast:
            x_RD = x_RD.to(torch.get_autocast_dtype(dev))
        dequant = spec.dequant_base(x_RD.dtype)
    elif autocast:
        dtype = torch.get_autocast_dtype(dev)
        x_RD, w1_EDW, w2_EFD = x_RD.to(dtype), w1_EDW.to(dtype), w2_EFD.to(dtype)
    elif x_RD.dtype != w1_EDW.dtype:
        x_RD = x_RD.to(w1_EDW.dtype)
    if lora.has_expert_adapters(spec):
        return run_lora_experts(spec, x_RD, w1_EDW, w2_EFD, batch, dequant)
    if runs_lean(spec):
        # the routing weights in the compute dtype once, here: the Function multiplies them in that
        # dtype in its forward, its recompute and its backward (three casts of w_R otherwise, and a
        # fourth of its gradient); autograd casts the gradient back (the same bits either way)
        w_R = batch.weights_R
        if w_R is not None and w_R.dtype != x_RD.dtype:
            w_R = w_R.to(x_RD.dtype)
        return lean_experts(x_RD, w1_EDW, w2_EFD, batch.offsets_E, w_R, batch.source,
                            spec.kind, spec.clamp, spec.softcap, spec.backend, dequant, batch.capacity)
    if dequant is not None:  # the plain composition: autograd keeps the weights
        w1_EDW, w2_EFD = dequant()
    # (a cast to the autocast dtype keeps MX-exact rows exact: 3 mantissa bits fit bf16's 7)
    h_R2F = expert_gemm(x_RD, w1_EDW, batch, spec.backend, spec.precision, batch.rows_format)
    if spec.kind == "swiglu" and spec.clamp is None and spec.softcap is None:
        h_RF = weighted_swiglu(h_R2F, batch.weights_R)
    else:
        h_RF = activation(h_R2F, spec.kind, spec.clamp, spec.softcap)
        if batch.weights_R is not None:
            h_RF = h_RF * batch.weights_R.to(h_RF.dtype).unsqueeze(-1)
    return expert_gemm(h_RF, w2_EFD, batch, spec.backend, spec.precision)


def run_lora_experts(spec: GroupedExperts | nn.Module, x_RD: torch.Tensor, w1_EDW: torch.Tensor | None,
                     w2_EFD: torch.Tensor | None, batch: ExpertBatch, dequant: Dequant | None = None
                     ) -> torch.Tensor:
    """The adapted expert MLP (train.lora; ops/lora_experts.py): the Function where the lean experts
    run, the plain composition elsewhere (the capacity layout; non-SwiGLU kinds under torch.compile).
    A base held narrow (QLoRA) comes as `dequant`, with w1 = w2 = None."""
    adapters = lora.expert_adapters(spec)
    dev = x_RD.device.type
    if autocast_available(dev) and torch.is_autocast_enabled(dev):
        adapters = tuple(t.to(x_RD.dtype) for t in adapters)
    if runs_lean(spec):
        return lora_experts(x_RD, w1_EDW, w2_EFD, adapters, spec.lora_scale, batch.offsets_E, batch.weights_R,
                            batch.source, spec.kind, spec.clamp, spec.softcap, spec.backend, dequant)
    if dequant is not None:
        w1_EDW, w2_EFD = dequant()
    return lora_experts_reference(x_RD, w1_EDW, w2_EFD, adapters, spec.lora_scale, batch.offsets_E,
                                  batch.weights_R, spec.kind, spec.clamp, spec.softcap,
                                  lambda x, w: expert_gemm(x, w, batch, spec.backend, spec.precision))
