"""The planner's fake-tensor world (plan/activations.py measures in it): the model's modules run on
`FakeTensorMode` tensors that claim to be on the CPU, so nothing is allocated, CPU autocast casts as
in training, and every op's autograd saves what it would save. Where a CPU kernel would keep other
tensors than the accelerator's, or has no fake implementation, a stand-in takes its place:
- grouped_mm in fp32 (torch's meta kernel takes bf16 only): `_GroupedMMStandIn`;
- the ops that read the expert group ends on the host (the `loop` backend's per-expert GEMMs,
  `grouped_mm_reference`, and every low-precision recipe's emulated GEMM, `quant_grouped_mm`): a
  fake tensor holds no values, so the real op runs with group ends of the planner's own, every
  whole token block of rows in the first expert (`_host_ends`). What these ops keep for the
  backward does not depend on the ends: the loop's slices are views of the rows and of the
  weights, and the recipes keep their unquantised operands whole;
- layers/offload.py's host copies: counted, not made (`_HostCopyStandIn`, `_pack_fake`);
- attention whose value heads are narrower than its query/key heads (MLA: 192 and 128 in
  DeepSeek-V3): the CPU has no fused kernel for it and its math path keeps an [S, S] matrix per
  head, which a GPU run does not (CUDA's memory-efficient kernel takes those widths): `_sdpa`
  runs that kernel's op, whose autograd keeps q, k, v, the output and the fp32 log-sum-exp, as
  the CPU flash kernel does where q, k and v are as wide (module note of plan/activations.py). A
  CPU run of such a model keeps more than the plan says.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

from ..layers import offload as offload_mod
from ..ops import grouped_gemm, quant_gemm


def storage_key(t: torch.Tensor) -> int:
    """A storage's identity (data_ptr is 0 for every fake and meta tensor)."""
    return t.untyped_storage()._cdata


class _GroupedMMStandIn(torch.autograd.Function):
    """fp32 grouped_mm on fake tensors: torch's meta kernel takes bf16 only (the CPU kernel takes
    fp32 too). Keeps what aten's grouped_mm keeps for its backward: both operands and the offsets."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(a, b, offs)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001
        raise RuntimeError("the planner's fake grouped_mm has no backward")


def _grouped_mm_any_dtype(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                          **kwargs: Any) -> torch.Tensor:
    if a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs, **kwargs)
    return _GroupedMMStandIn.apply(a, b, offs)


def _host_ends(rows_RD: torch.Tensor, num_experts: int, block: int = 1) -> torch.Tensor:
    """Group ends a host read can take (a real tensor: fake ones hold no values): every whole
    `block` of the rows in the first group, the others empty (module note)."""
    rows = rows_RD.shape[0]
    with unset_fake_temporarily():
        return torch.full((num_experts,), rows - rows % block, dtype=torch.int32)


_real_loop_mm = grouped_gemm.grouped_mm_reference
_real_quant_mm = quant_gemm.quant_grouped_mm


def _loop_mm_fake(x_RD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return _real_loop_mm(x_RD, w_EDF, _host_ends(x_RD, w_EDF.shape[0]))


def _quant_mm_fake(x_RD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor,
                   precision: str, rows_format: str | None = None) -> torch.Tensor:
    ends = _host_ends(x_RD, w_EDF.shape[0], quant_gemm.recipe(precision).token_block)
    return _real_quant_mm(x_RD, w_EDF, ends, precision, rows_format)


class _HostCopyStandIn:
    """layers/offload.py's host copy on fake tensors: the storage's size, nothing allocated (the
    real one would allocate a host storage of that size and copy a fake one into it)."""

    def __init__(self, t: torch.Tensor, stream: Any) -> None:
        self.device, self.nbytes, self.stream, self.restored = t.device, t.untyped_storage().nbytes(), None, None

    def restore(self) -> torch.UntypedStorage:
        raise RuntimeError("the planner's fake offload has no backward")


_real_pack = offload_mod.OffloadScope.pack


def _pack_fake(scope: offload_mod.OffloadScope, t: torch.Tensor) -> Any:
    """OffloadScope.pack for fake tensors. The real one leaves every tensor subclass in place (it
    moves plain tensors only), and on fake tensors every tensor is a FakeTensor: this takes a fake
    plain tensor as the real pack takes a plain one (parameters, their views and the keep tensors
    stay, each other storage is copied once) and counts it the same way."""
    if (type(t) is not FakeTensor or t.layout != torch.strided or t.device.type != "cpu"
            or storage_key(t) in scope.keep):
        return _real_pack(scope, t)  # a parameter (or a view of one) or a kept table: left in place
    count, key = scope.offloader.counter, storage_key(t)
    if key not in scope.copies:
        copy = offload_mod._HostCopy(t, None)
        scope.copies[key] = (copy, t.untyped_storage())
        count.storages += 1
        count.bytes_to_host += copy.nbytes
    count.tensors += 1
    return t  # no backward runs here


_real_sdpa = F.scaled_dot_product_attention


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention as an accelerator runs it (module note): value heads narrower
    or wider than the query heads go to the memory-efficient kernel's op, under autocast in its
    dtype as the public op would be; everything else to the real op."""
    if q.shape[-1] == v.shape[-1] or attn_mask is not None or enable_gqa or dropout_p:
        return _real_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal,
                                                                  scale=scale)[0]


@contextlib.contextmanager
def fake_world() -> Iterator[None]:
    """Fake tensors on the 'cpu', with the stand-ins of the module note in place."""
    real, real_copy = grouped_gemm._grouped_mm, offload_mod._HostCopy
    grouped_gemm._grouped_mm = _grouped_mm_any_dtype
    grouped_gemm.grouped_mm_reference = _loop_mm_fake
    quant_gemm.quant_grouped_mm = _quant_mm_fake
    offload_mod._HostCopy = _HostCopyStandIn
    offload_mod.OffloadScope.pack = _pack_fake
    F.scaled_dot_product_attention = _sdpa
    try:
        with FakeTensorMode():
            yield
    finally:
        grouped_gemm._grouped_mm = real
        grouped_gemm.grouped_mm_reference = _real_loop_mm
        quant_gemm.quant_grouped_mm = _real_quant_mm
        offload_mod._HostCopy = real_copy
        offload_mod.OffloadScope.pack = _real_pack
        F.scaled_dot_product_attention = _real_sdpa
