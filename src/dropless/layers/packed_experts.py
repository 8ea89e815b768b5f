"""Routed experts stored in 4 bits (MXFP4 or NVFP4), dequantised per step for the experts it uses.

Legend: R routed rows (expert-major), E experts, A experts with rows in this batch, D model width,
F expert width, W the gate|up width (2F for gated activations, F otherwise), X the reduction width of
a weight (D for gate|up, F for down), Y its output width, N = X / block.
    gate_up_codes_EHW   uint8 (E, D/2, W): two E2M1 codes per byte along D (element 2i low nibble)
    gate_up_scales_ENW  uint8 (E, D/block, W): E8M0 bytes (mxfp4) or E4M3 bytes (nvfp4)
    down_codes_EHD      uint8 (E, F/2, D), down_scales_END uint8 (E, F/block, D)
    *_tensor_scale_E    int32 (E,): the bits of NVFP4's per-expert fp32 tensor scale (nvfp4 only)

Design note
-----------
An inference-only replacement for `GroupedExperts` with the same forward contract
(`forward(batch: ExpertBatch) -> y_RD`, the routing weights applied before the down GEMM, as in
layers/experts.py). It keeps the bytes a 4-bit kernel would read, not fp32 copies: 4.25 bits per
weight for mxfp4 (E2M1 + one E8M0 per 32), 4.5 + 32/(X*Y) for nvfp4 (E2M1 + one E4M3 per 16 + one
fp32 per expert matrix).

Which numbers. Each weight is blocked along its *reduction* dim (X, dim -2 of w_EDF and of w_EFD)
with NVFP4's tensor scale taken per expert: exactly how `ops.quant_gemm` quantises weights for the
forward GEMM (`_fq_weight(w, fmt, -2)`). So the dequantised weights are bit for bit what the training
emulation (`moe.precision = mxfp4 | nvfp4`) and `ops.quant.fake_quantize` produce, and a packed model
computes what the original model computes with its expert weights replaced by their fake-quantised
values. The encoding (rounding, saturation, NaN-in-scale, nibble order) is `ops.quant`'s; nothing here
re-derives it.

Which experts. The forward reads the group ends on the host (one sync per layer call), finds the
experts that have rows, dequantises only those to fp32 and runs the GEMMs on the A groups that are
non-empty. At decode (T = batch size, K experts per token) that is at most T*K of the E experts.
The host read is acceptable at inference, never inside a training step: the module refuses to run in
training mode (it has no parameters to train, and a trainer would be optimising a model whose experts
silently never move). The capacity layout (every expert holds C slots, padding included) dequantises
every expert, since the plan gives every expert rows.

The tensor scale is held as int32 bits rather than an fp32 buffer so that `model.to(torch.bfloat16)`
(which casts floating-point buffers) cannot round it; the codes and block scales are uint8 for the
same reason, and because CPU indexing of float8 dtypes is not guaranteed.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import quant_gemm
from ..ops.activations import is_gated
from ..ops.quant import FORMATS, QTensor, dequantize, quantize
from .experts import ExpertBatch, GroupedExperts, run_experts

PACKED_FORMATS: tuple[str, ...] = ("mxfp4", "nvfp4")
_WEIGHTS = ("gate_up", "down")


def check_format(fmt: str) -> int:
    """The format's block size; ValueError for an unknown format."""
    if fmt not in PACKED_FORMATS:
        raise ValueError(f"experts={fmt!r}: unknown 4-bit format; expected one of "
                         f"{', '.join(PACKED_FORMATS)}")
    return FORMATS[fmt][1]


def check_packable(fmt: str, d_model: int, d_expert: int, d_model_field: str = "model.d_model") -> int:
    """The format's block size; ValueError for an unknown format or a width it does not divide.
    `d_model`: the experts' row width, the field `d_model_field` (LatentMoE: model.moe.latent_dim)."""
    block = check_format(fmt)
    for name, width in ((d_model_field, d_model), ("model.moe.d_expert", d_expert)):
        if width % block:
            raise ValueError(f"{name}={width} is not a multiple of the {fmt} block size {block} (the "
                             f"expert weights are blocked along both widths); this run cannot be packed")
    return block


def pack_weight(w_EXY: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stacked expert weights -> (codes uint8 (E, X/2, Y), block scales uint8 (E, X/block, Y), tensor
    scale bits int32 (E,) or None), blocked along X (the reduction dim), NVFP4's tensor scale per
    expert."""
    w = w_EXY.detach().float()
    if fmt == "nvfp4":  # one tensor scale per expert matrix, as quant_gemm._fq_weight takes it
        qs = [quantize(w_XY, fmt, dim=0) for w_XY in w]
        codes = torch.stack([q.data for q in qs])
        scales = torch.stack([q.scale.view(torch.uint8) for q in qs])
        tensor_scale = torch.stack([q.global_scale.float() for q in qs]).view(torch.int32)
        return codes, scales, tensor_scale
    q = quantize(w, fmt, dim=1)
    return q.data, q.scale.view(torch.uint8), None


def unpack_weight(codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
                  fmt: str) -> torch.Tensor:
    """Inverse of `pack_weight`: fp32 (A, X, Y), `ops.quant.dequantize` of the same bytes."""
    A, H, Y = codes.shape
    global_scale = None
    if fmt == "nvfp4":
        assert tensor_scale is not None, "nvfp4 weights without their tensor scales"
        scales = scales.view(torch.float8_e4m3fn)
        # dequantize multiplies (element * block scale) * tensor scale; (A, 1, 1, 1) broadcasts one
        # tensor scale per expert over its (Y, N, block) values, the same product per element
        global_scale = tensor_scale.view(torch.float32).view(A, 1, 1, 1)
    q = QTensor(data=codes, scale=scales, global_scale=global_scale, fmt=fmt,
                shape=torch.Size((A, 2 * H, Y)), dim=1, block=FORMATS[fmt][1])
    return dequantize(q, torch.float32)


class PackedExperts(nn.Module):
    """GroupedExperts' forward over 4-bit stored weights; see the module docstring."""

    def __init__(self, num_experts: int, d_model: int, d_expert: int, fmt: str, kind: str = "swiglu",
                 clamp: float | None = None, softcap: float | None = None, backend: str = "grouped_mm",
                 precision: str = "bf16") -> None:
        super().__init__()
        block = check_packable(fmt, d_model, d_expert)
        self.fmt, self.kind, self.clamp, self.softcap = fmt, kind, clamp, softcap
        self.backend, self.precision = backend, precision
        self.num_experts, self.d_model, self.d_expert = num_experts, d_model, d_expert
        self.row_align = quant_gemm.plan_align(precision, 1)  # what GroupedExperts declares
        width = 2 * d_expert if is_gated(kind) else d_expert
        for name, (x, y) in zip(_WEIGHTS, ((d_model, width), (d_expert, d_model))):
            self.register_buffer(f"{name}_codes", torch.zeros(num_experts, x // 2, y, dtype=torch.uint8))
            self.register_buffer(f"{name}_scales", torch.zeros(num_experts, x // block, y, dtype=torch.uint8))
            if fmt == "nvfp4":
                self.register_buffer(f"{name}_tensor_scale", torch.zeros(num_experts, dtype=torch.int32))

    @classmethod
    def from_experts(cls, experts: GroupedExperts, fmt: str) -> PackedExperts:
        """Quantise a trained GroupedExperts' weights into a new PackedExperts on the same device."""
        E, D, _ = experts.w_gate_up_EDF.shape
        F = experts.w_down_EFD.shape[1]
        packed = cls(E, D, F, fmt, experts.kind, experts.clamp, experts.softcap, experts.backend,
                     experts.precision).to(experts.w_gate_up_EDF.device)
        for name, w in zip(_WEIGHTS, (experts.w_gate_up_EDF, experts.w_down_EFD)):
            codes, scales, tensor_scale = pack_weight(w, fmt)
            getattr(packed, f"{name}_codes").copy_(codes)
            getattr(packed, f"{name}_scales").copy_(scales)
            if tensor_scale is not None:
                getattr(packed, f"{name}_tensor_scale").copy_(tensor_scale)
        return packed

    def dequantized(self, ids_A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (w_gate_up_ADW, w_down_AFD) of experts `ids_A` (int64), only those dequantised. Also
        the entry point for a decode path that gathers the chosen experts' weights itself."""
        out = []
        for name in _WEIGHTS:
            ts = getattr(self, f"{name}_tensor_scale", None)
            out.append(unpack_weight(getattr(self, f"{name}_codes")[ids_A],
                                     getattr(self, f"{name}_scales")[ids_A],
                                     None if ts is None else ts[ids_A], self.fmt))
        return out[0], out[1]

    def packed_bytes_per_expert(self) -> int:
        """Bytes one expert's packed weights occupy (codes, block scales, tensor scales)."""
        return sum(b.numel() * b.element_size() for b in self.buffers()) // self.num_experts

    def forward(self, batch: ExpertBatch) -> torch.Tensor:
        if self.training:
            raise RuntimeError("PackedExperts is inference-only (4-bit stored experts, a host read per "
                               "call, no parameters): call model.eval(); train from the original run")
        if batch.capacity is not None:  # every expert holds C slots: all of them are used
            ids_A = torch.arange(self.num_experts, device=batch.x_RD.device)
            sub = batch
        else:
            ends = batch.offsets_E.tolist()  # host read (see the module docstring)
            active = [e for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)) if t > s]
            if not active:  # no rows: nothing to compute (the rows past the last group are unread)
                return batch.x_RD.new_zeros(batch.x_RD.shape)
            ids_A = torch.tensor(active, device=batch.offsets_E.device)
            # the empty groups hold no rows, so the non-empty groups' ends tile the same rows
            sub = ExpertBatch(batch.x_RD, batch.offsets_E[ids_A], None, batch.weights_R)
        w1, w2 = self.dequantized(ids_A)
        return run_experts(self, sub.x_RD, w1, w2, sub)
