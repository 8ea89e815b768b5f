"""Grouped matrix products over ragged groups of rows.

Legend: R rows in expert order, E experts, D input width, F output width.
    x_RD       rows, expert-major (group e occupies rows [offsets_E[e-1], offsets_E[e]))
    w_EDF      one weight matrix per expert
    offsets_E  int32 group ends, on the device

Backends:
- `grouped_mm_reference`: a loop over experts. Reads the offsets on the host (a sync), so it is the
  executable specification and the fallback for tests, never the training path.
- `grouped_mm`: torch's `grouped_mm` (cuBLAS/CUTLASS on GPU, a native kernel on CPU). One call for all
  groups, offsets stay on the device. Its constraints: int32 offsets; every row stride a multiple of
  16 bytes (so D and F multiples of 8 in bf16, of 4 in fp32), handled here by zero-padding the width;
  the incoming gradient must be contiguous (an expanded gradient such as that of `.sum()` fails), so
  the output passes through `_ContiguousGrad`. Rows past offsets_E[-1] are left uninitialised: the
  routing plan never reads them.
- `padded_bmm`: the capacity layout, every expert holding exactly C rows: one batched matmul.

The two backward products of `x_RD @ w_EDF`, for autograd Functions that own their backward
(ops/lean_experts.py): `grouped_dgrad` (g_RF @ w_EDF^T per group) and `grouped_wgrad` (x^T @ g per
group, the group dimension reduced: a 2-d x 2-d grouped GEMM with the offsets on the reduced dim),
each with a `backend` of "grouped_mm" or "loop". They are the products torch's own autograd runs for
the forward above (derivatives.yaml `_grouped_mm`: `_grouped_mm(grad, mat2.transpose(-2, -1), offs)`
and `_grouped_mm(self.transpose(-2, -1), grad, offs)`; for the loop, mm's backward per expert), on
the same padded operands and views, so their results are the same bits as autograd's
(tests/test_grouped_gemm.py checks it with torch.equal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from .grouped_mm_op import _native, traced


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return traced(a, b, offs)  # torch's op; traceable at any dtype under compile (grouped_mm_op.py)


def has_grouped_mm() -> bool:
    return _native is not None


# oneDNN, which runs torch's bf16/fp16 matmuls on the CPU, creates a kernel for each GEMM shape it
# meets and caches it (ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1024 by default). torch's CPU grouped_mm is one
# matmul per expert group, and dropless groups are as ragged as the routing: nearly every step meets
# new row counts, and each new shape pays the kernel's creation (measured ~10 ms, 1 thread, beside
# ~2 ms for a 1000 x 256 x 512 bf16 product: a loop of such products with random row counts ran at 14-20
# GFLOP/s against 120-150 with one fixed count). Rounding each group up to a multiple of this many
# rows (zero padding rows, which the plan already knows how to make) leaves few distinct shapes, all
# cached after the first steps: the default preset's MoE layer, forward and backward under bf16
# autocast, 1178 -> 709 ms (docs/training_speed.md, "Where a CPU training step goes"). MKL's fp32 GEMM has
# no such cost, so fp32 plans stay unpadded (and bit-identical to before). Only where groups average at
# least 8 buckets (256 rows): the padding, about half a bucket per group, then costs at most ~6% more
# rows; small calls (tests, decoding-sized batches) keep their plans.
CPU_LOWP_ROW_BUCKET = 32


def row_bucket(x: torch.Tensor, rows_per_group: float) -> int:
    """The row alignment the expert GEMMs want for rows like `x` in the current autocast state, with
    groups of `rows_per_group` rows on average: 32 for bf16/fp16 GEMMs on the CPU with groups of at
    least 8 x 32 rows (note above), 1 elsewhere."""
    dev = x.device.type
    if dev != "cpu" or rows_per_group < 8 * CPU_LOWP_ROW_BUCKET:
        return 1
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    return CPU_LOWP_ROW_BUCKET if dtype in (torch.bfloat16, torch.float16) else 1


# The same per-expert matmuls use the two cores badly: a group of a few hundred rows is too small a
# product to split over threads (16 x 512 x 256 x 512 bf16 on the 2-core AMX CPU: grouped_mm 2.1 ms at
# 2 threads, 2.5 at 1; two Python threads of one-thread matmuls did not help), while one batched matmul
# over the same groups splits the batch: 0.95 ms at 2 threads, 1.7 at 1. So on the CPU a plan whose
# groups are nearly even pads them all to the largest (permute.make_plan `uniform_limit`) and the
# experts run `torch.bmm`. The four products of a layer's forward and backward (E 16, D 256, F 256
# SwiGLU), bmm over E*C rows against grouped_mm over the aligned rows, with one group C rows long
# (scripts/steptune/uniform_bmm.py, 2-core AMX CPU):
#   rows E*C / aligned  1.00  1.23  1.45  1.98
#   2 threads           0.46  0.56  0.64  0.83
#   1 thread            0.69  0.83  0.98  1.31
# The limits sit below break-even (~2.2 and ~1.45). Padding rows cost memory too: the kept
# pre-activation grows by the same factor (docs/memory.md).
UNIFORM_LIMIT = {1: 1.25}
UNIFORM_LIMIT_THREADED = 1.75


def uniform_limit(x: torch.Tensor, bucket: int) -> float | None:
    """The most padding (as a factor of rows) worth a batched matmul over uniform groups for rows like
    `x`, or None where plans stay ragged: only where `row_bucket` pads (bf16/fp16 on the CPU, large
    groups), never under torch.compile or on fake tensors (the decision reads counts on the host)."""
    if bucket <= 1 or torch.compiler.is_compiling() or is_fake(x):
        return None
    return UNIFORM_LIMIT.get(torch.get_num_threads(), UNIFORM_LIMIT_THREADED)


def grouped_mm_reference(x_RD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    ends = offsets_E.tolist()
    starts = [0] + ends[:-1]
    parts = [x_RD[s:e] @ w_EDF[i] for i, (s, e) in enumerate(zip(starts, ends))]
    tail = x_RD.shape[0] - ends[-1]
    if tail:
        parts.append(x_RD.new_zeros(tail, w_EDF.shape[-1]))
    return torch.cat(parts)


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def _int32(offsets_E: torch.Tensor) -> torch.Tensor:
    """The offsets as grouped_mm takes them (int32), without a call when they are int32 already."""
    return offsets_E if offsets_E.dtype == torch.int32 else offsets_E.to(torch.int32)


def _pad_to(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def grouped_mm(x_RD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor,
               group_rows: int | None = None) -> torch.Tensor:
    """`group_rows`: every group is that many rows (a uniform plan): one batched matmul."""
    if group_rows is not None:
        return padded_bmm(x_RD, w_EDF, group_rows)
    if _native is None:
        raise RuntimeError("this torch has no grouped_mm; use backend='loop' or torch >= 2.9")
    mult = 16 // x_RD.element_size()
    D, Fo = w_EDF.shape[-2:]
    Dp, Fp = _pad_to(D, mult), _pad_to(Fo, mult)
    if Dp != D or Fp != Fo:
        # Zero columns in x and zero rows in w add nothing to the product; extra output columns
        # are sliced off. Costs one copy of each operand, only for widths that break alignment.
        x_RD = F.pad(x_RD, (0, Dp - D))
        w_EDF = F.pad(w_EDF, (0, Fp - Fo, 0, Dp - D))
    y = _grouped_mm(x_RD.contiguous(), w_EDF, offs=_int32(offsets_E))
    y = _ContiguousGrad.apply(y)
    return y[:, :Fo] if Fp != Fo else y


def _padded(x_RD: torch.Tensor, D: int, Fo: int) -> tuple[int, int]:
    mult = 16 // x_RD.element_size()
    return _pad_to(D, mult), _pad_to(Fo, mult)


def grouped_dgrad(g_RF: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor,
                  backend: str = "grouped_mm", group_rows: int | None = None) -> torch.Tensor:
    """dx_RD of y = grouped_mm(x_RD, w_EDF): g_RF @ w_EDF[e]^T on group e. Rows past the last group
    end are left uninitialised ("grouped_mm", as autograd's) or zero ("loop"): nothing reads them.
    `group_rows` (uniform groups, "grouped_mm"): bmm's own backward product."""
    D, Fo = w_EDF.shape[-2:]
    if group_rows is not None and backend == "grouped_mm":
        E = w_EDF.shape[0]
        return torch.bmm(g_RF.view(E, group_rows, Fo), w_EDF.transpose(-2, -1)).view(E * group_rows, D)
    if backend == "loop":
        ends = offsets_E.tolist()
        parts = [g_RF[s:e].mm(w_EDF[i].t()) for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))]
        tail = g_RF.shape[0] - ends[-1]
        if tail:
            parts.append(g_RF.new_zeros(tail, D))
        return torch.cat(parts)
    Dp, Fp = _padded(g_RF, D, Fo)
    if Dp != D or Fp != Fo:  # the operands the forward padded, padded the same way
        g_RF = F.pad(g_RF, (0, Fp - Fo))
        w_EDF = F.pad(w_EDF, (0, Fp - Fo, 0, Dp - D))
    dx = _grouped_mm(g_RF.contiguous(), w_EDF.transpose(-2, -1), offs=_int32(offsets_E))
    return dx[:, :D] if Dp != D else dx


def grouped_wgrad(x_RD: torch.Tensor, g_RF: torch.Tensor, offsets_E: torch.Tensor,
                  backend: str = "grouped_mm", group_rows: int | None = None) -> torch.Tensor:
    """dw_EDF of y = grouped_mm(x_RD, w_EDF): x^T @ g summed over group e's rows (zero for an empty
    group; rows past the last group end are not read). `group_rows` (uniform groups, "grouped_mm"):
    bmm's own backward product."""
    D, Fo = x_RD.shape[-1], g_RF.shape[-1]
    if group_rows is not None and backend == "grouped_mm":
        E = offsets_E.shape[0]
        return torch.bmm(x_RD.view(E, group_rows, D).transpose(1, 2), g_RF.view(E, group_rows, Fo))
    if backend == "loop":
        ends = offsets_E.tolist()
        return torch.stack([x_RD[s:e].t().mm(g_RF[s:e]) for s, e in zip([0] + ends[:-1], ends)])
    Dp, Fp = _padded(x_RD, D, Fo)
    if Dp != D or Fp != Fo:
        x_RD = F.pad(x_RD, (0, Dp - D))
        g_RF = F.pad(g_RF, (0, Fp - Fo))
    dw = _grouped_mm(x_RD.contiguous().transpose(-2, -1), g_RF.contiguous(),
                     offs=_int32(offsets_E))
    return dw[:, :D, :Fo] if Dp != D or Fp != Fo else dw


def padded_bmm(x_RD: torch.Tensor, w_EDF: torch.Tensor, capacity: int) -> torch.Tensor:
    E = w_EDF.shape[0]
    y_ECF = torch.bmm(x_RD.view(E, capacity, -1), w_EDF)
    return y_ECF.view(E * capacity, -1)
