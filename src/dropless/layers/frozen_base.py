"""The frozen base of a LoRA run held narrow (train.lora.base): bf16 matrices, packed routed experts.

Legend: E experts (the local ones under expert parallelism), X the reduction width of an expert
weight (D for gate|up, F for down), Y its output width, n = X * Y weights per expert matrix.
    w_gate_up_codes   uint8 (E, X/2, Y) two E2M1 codes per byte (mxfp4, nvfp4), (E, X, Y) E4M3 bytes (fp8)
    w_gate_up_scales  uint8 (E, X/block, Y): E8M0 bytes (fp8, mxfp4) or E4M3 bytes (nvfp4)
    w_gate_up_tensor_scale  int32 (E,): the bits of NVFP4's fp32 scale per expert matrix (nvfp4 only)
    w_down_*          the same for w_down_EFD

What each base holds (bytes per weight of the routed experts; the other frozen matrices bf16 for
every base but fp32):
    fp32   4 (as loaded: nothing here runs)
    bf16   2
    fp8    1 + 1/32      MXFP8: E4M3 with one E8M0 scale per 32 (ops/quant.py "mxfp8_e4m3")
    mxfp4  0.5 + 1/32    E2M1 with one E8M0 scale per 32 (4.25 bits)
    nvfp4  0.5 + 1/16    E2M1 with one E4M3 scale per 16, plus 4 B per expert matrix (4.5 bits)
Blocks run along the reduction dim, NVFP4's tensor scale is per expert: layers/packed_experts.py's
layout (the 4-bit codes are its `pack_weight`'s, byte for byte), so the dequantised weights are
`ops.quant.fake_quantize` of the weights bit for bit and a packed run computes what the model with
its experts replaced by their fake-quantised values computes (tests/test_qlora.py).

Two steps, because the narrow matrices must exist before FSDP2 wraps the model and the packed ones
need values:
- `hold_frozen_base` (model_lora.freeze, at construction, on the meta device): every frozen
  nn.Linear weight inside the blocks and MTP modules becomes bf16 (its bias stays fp32: a vector),
  and for every base but fp32 the routed experts' stacks too. The fill then writes bf16 (the initial
  weights are drawn in fp32 and rounded once, a bf16 checkpoint is copied exactly), FSDP2 shards
  the narrow tensors (it asks one dtype of the trainable parameters only), and the planner's meta
  model holds what the run holds. A plain nn.Linear becomes a `BaseLinear` by class (same module, same
  hooks, same state-dict names) so that it computes in its input's dtype, as LoRALinear does; outside
  autocast both go through ops/frozen_linear.py, which keeps the bf16 weight for the backward, not
  its cast copy.
  The embedding and LM head stay fp32: the embedding's output is the residual stream, whose dtype
  would become bf16 in an fp32 run, and the head is often that same tensor (tied). The routers stay
  fp32: routing is computed in fp32 by design (layers/router.py).
- `pack_frozen_base` (after the fill, before the optimizer): for fp8, mxfp4 and nvfp4 the routed
  experts' bf16 stacks are replaced by the uint8 buffers above, packed a few experts at a time.
  Buffers, not parameters, non-persistent: a LoRA run checkpoints its adapters and rebuilds the base
  from its source at each start (lora_config.py), so the packed bytes are derived, never saved.

How the experts read their base: `GroupedExperts.dequant_base(dtype)` (set here) gives the zero-arg
callable of ops/lora_experts.py, returning (w1, w2) of all the layer's experts in the compute dtype,
and the experts pass w1 = w2 = None (layers/experts.py). It is called once in the forward and once
in the backward: the weights are never kept between them (the lean and LoRA Functions save None for
them); the transient is one layer's stacks in the compute dtype plus one chunk in fp32
(`CHUNK_BYTES`). No host read: the experts are dequantised whole, whatever the batch routes.

Limit: packing needs the experts as plain local tensors. Every distributed run wraps them in
FSDP2 (distributed/parallelize.py, even with one expert-data-parallel rank), so a packed base is
for one process (lora_config.check_lora_model refuses parallel.ep_size > 1; `pack_frozen_base`
refuses a DTensor). The bf16 base works under FSDP2: it is narrowed on meta, before the wrap.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import frozen_linear
from ..ops.lora_experts import Dequant
from ..ops.quant import QTensor, dequantize, quantize
from .experts import GroupedExperts
from .packed_experts import pack_weight, unpack_weight

# train.lora.base -> the ops/quant.py format of the packed experts
PACKED = {"fp8": "mxfp8_e4m3", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
BLOCK = {"fp8": 32, "mxfp4": 32, "nvfp4": 16}
WEIGHTS = ("w_gate_up", "w_down")
STACKS = ("w_gate_up_EDF", "w_down_EFD")
CHUNK_BYTES = 256 * 2**20  # fp32 bytes of experts packed or dequantised per step (the transient)


class BaseLinear(nn.Linear):
    """A frozen nn.Linear held in bf16, computed in its input's dtype (as LoRALinear does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if frozen_linear.applies(x, w, b):  # the fp32 copy of w is not kept for the backward
            return frozen_linear.frozen_linear(x, w, b)
        return nn.functional.linear(x, w, b if b is None or b.dtype == w.dtype else b.to(w.dtype))


def _narrow(module: nn.Module, name: str, base: str) -> None:
    p = getattr(module, name)
    if p.dtype != torch.bfloat16:
        if _is_dtensor(p):
            raise ValueError(f"train.lora.base={base!r}: the frozen matrices are made bf16 at construction, "
                             "on the meta device, before FSDP2 wraps them (model_lora.freeze); this model's "
                             f"{name} is an fp32 DTensor (built without train.lora?)")
        setattr(module, name, nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False))


def hold_frozen_base(model: nn.Module, base: str) -> None:
    """The frozen matrices of `model` (an MoEModel whose base is frozen) in bf16, and the routed
    experts read through `dequant_base` (module note); nothing for "fp32". Idempotent."""
    if base == "fp32":
        return
    head = getattr(model, "head", None)
    skip = {id(head)} if head is not None else set()
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module) not in skip and not module.weight.requires_grad:
            _narrow(module, "weight", base)
            if type(module) is nn.Linear:
                module.__class__ = BaseLinear
        elif isinstance(module, GroupedExperts) and module.dequant_base is None and \
                not any(getattr(module, name).requires_grad for name in STACKS):
            for name in STACKS:
                _narrow(module, name, base)
            module.dequant_base = BaseReader(module, "bf16")


def _is_dtensor(p: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


class BaseReader:
    """`GroupedExperts.dequant_base`: dtype -> the zero-arg callable of (w1, w2) in `dtype`, from the
    experts' stacks as stored ("bf16": the parameters; otherwise the packed buffers)."""

    def __init__(self, experts: GroupedExperts, base: str) -> None:
        self.experts, self.base = experts, base

    def __call__(self, dtype: torch.dtype) -> Dequant:
        return lambda: self.weights(dtype)

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        ex = self.experts
        if self.base == "bf16":
            return ex.w_gate_up_EDF.to(dtype), ex.w_down_EFD.to(dtype)
        return tuple(unpack_stack(*packed_buffers(ex, w), self.base, dtype) for w in WEIGHTS)  # type: ignore


def packed_buffers(experts: nn.Module, weight: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return (getattr(experts, f"{weight}_codes"), getattr(experts, f"{weight}_scales"),
            getattr(experts, f"{weight}_tensor_scale", None))


def _pack(w_EXY: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scales, tensor scale bits) of a few experts; the 4-bit ones are packed_experts'."""
    fmt = PACKED[base]
    if base != "fp8":
        return pack_weight(w_EXY, fmt)
    q = quantize(w_EXY.detach().float(), fmt, dim=1)
    return q.data.view(torch.uint8), q.scale.view(torch.uint8), None


def _unpack(codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
            base: str) -> torch.Tensor:
    """fp32 (A, X, Y): `ops.quant.dequantize` of the bytes `_pack` made."""
    if base != "fp8":
        return unpack_weight(codes, scales, tensor_scale, PACKED[base])
    q = QTensor(data=codes.view(torch.float8_e4m3fn), scale=scales, global_scale=None, fmt=PACKED[base],
                shape=codes.shape, dim=1, block=BLOCK[base])
    return dequantize(q, torch.float32)


def _chunks(E: int, n: int) -> list[tuple[int, int]]:
    """Expert ranges of at most CHUNK_BYTES of fp32 weights each (one expert at least)."""
    step = max(1, CHUNK_BYTES // max(4 * n, 1))
    return [(a, min(a + step, E)) for a in range(0, E, step)]


def pack_stack(w_EXY: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A stacked expert weight -> (codes, scales, tensor scale bits or None), a chunk of experts at a
    time (the blocks never cross an expert, NVFP4's tensor scale is per expert: the same bytes as
    packing the stack whole)."""
    E, X, Y = w_EXY.shape
    block = BLOCK[base]
    if X % block:
        raise ValueError(f"train.lora.base={base!r}: an expert weight's reduction width {X} is not a "
                         f"multiple of the block {block}")
    dev = w_EXY.device
    codes = torch.empty(E, X if base == "fp8" else X // 2, Y, dtype=torch.uint8, device=dev)
    scales = torch.empty(E, X // block, Y, dtype=torch.uint8, device=dev)
    ts = torch.empty(E, dtype=torch.int32, device=dev) if base == "nvfp4" else None
    for a, b in _chunks(E, X * Y):
        c, s, t = _pack(w_EXY[a:b], base)
        codes[a:b], scales[a:b] = c, s
        if ts is not None:
            ts[a:b] = t
    return codes, scales, ts


def unpack_stack(codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None, base: str,
                 dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `pack_stack`, in `dtype` (each chunk dequantised in fp32, then rounded once)."""
    E, H, Y = codes.shape
    X = H if base == "fp8" else 2 * H
    out = torch.empty(E, X, Y, dtype=dtype, device=codes.device)
    for a, b in _chunks(E, X * Y):
        out[a:b] = _unpack(codes[a:b], scales[a:b], None if tensor_scale is None else tensor_scale[a:b], base)
    return out


def pack_experts(experts: GroupedExperts, base: str) -> None:
    """Replace the experts' stacks by their packed buffers (module note) and read through them."""
    for weight, stack in zip(WEIGHTS, STACKS):
        w = getattr(experts, stack)
        if _is_dtensor(w):
            raise ValueError(f"train.lora.base={base!r} packs the routed experts in one process only: here "
                             "FSDP2 holds them as DTensors (a distributed run; use 'bf16')")
        codes, scales, ts = pack_stack(w, base)
        delattr(experts, stack)  # the parameter goes: its bytes are freed before the next is packed
        experts.register_buffer(f"{weight}_codes", codes, persistent=False)
        experts.register_buffer(f"{weight}_scales", scales, persistent=False)
        if ts is not None:
            experts.register_buffer(f"{weight}_tensor_scale", ts, persistent=False)
    experts.dequant_base = BaseReader(experts, base)


def pack_frozen_base(model: nn.Module, base: str) -> None:
    """After the base weights are filled (and EP has sliced the experts), before the optimizer is
    built: pack every GroupedExperts' frozen stacks for fp8, mxfp4, nvfp4 (module note); nothing
    for fp32 and bf16 (held at construction). Idempotent."""
    if base not in PACKED:
        return
    hold_frozen_base(model, base)  # a model built without it (no-op when built with train.lora)
    for module in model.modules():
        if isinstance(module, GroupedExperts) and hasattr(module, STACKS[0]):
            if module.w_gate_up_EDF.requires_grad or module.w_down_EFD.requires_grad:
                raise ValueError(f"train.lora.base={base!r}: the routed experts train (they are not frozen)")
            pack_experts(module, base)


def stored_bytes(base: str, E: int, X: int, Y: int) -> int:
    """Bytes of E expert matrices [X, Y] of the frozen base as `base` stores them (codes, scales and
    tensor scales; what `pack_stack` allocates)."""
    n = E * X * Y
    if base == "fp32":
        return 4 * n
    if base == "bf16":
        return 2 * n
    codes = n if base == "fp8" else n // 2
    return codes + n // BLOCK[base] + (4 * E if base == "nvfp4" else 0)


def frozen_base_bytes(model: nn.Module) -> dict[str, int]:
    """The frozen base's bytes as held now, by part: the routed experts' codes, scales and tensor
    scales (a bf16 or fp32 stack counts as codes), and every other frozen parameter (by its dtype),
    each tensor once. For the planner's check and `bench`."""
    out = {"expert_codes": 0, "expert_scales": 0, "expert_tensor_scales": 0, "other": 0}
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for weight, stack in zip(WEIGHTS, STACKS):
                if hasattr(module, stack):
                    p = getattr(module, stack)
                    if not p.requires_grad:
                        seen.add(id(p))
                        out["expert_codes"] += p.numel() * p.element_size()
                    continue
                codes, scales, ts = packed_buffers(module, weight)
                out["expert_codes"] += codes.numel()
                out["expert_scales"] += scales.numel()
                out["expert_tensor_scales"] += 0 if ts is None else 4 * ts.numel()
    for p in model.parameters():
        if not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out["other"] += p.numel() * p.element_size()
    out["experts"] = out["expert_codes"] + out["expert_scales"] + out["expert_tensor_scales"]
    out["total"] = out["experts"] + out["other"]
    return out
