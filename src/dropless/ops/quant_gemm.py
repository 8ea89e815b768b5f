"""Quantised grouped GEMM for training the routed experts (mission section 6).

Legend: R rows in expert order, E experts, D reduction width of the forward GEMM, F output width.
    x_RD       rows, expert-major (group e occupies rows [offsets_E[e-1], offsets_E[e]))
    w_EDF      one weight matrix per expert
    dy_RF      gradient of the output rows
    offsets_E  int32 group ends (the routing plan's, padded to the token block)

Design note
-----------
A linear layer trains with three GEMMs, and each one reduces over a different dim, so each quantises
its two operands along ITS OWN reduction dim (a block scale must be constant along the sum):

| GEMM    | product (per expert e)        | x / dy quantised along | w quantised along      |
|---------|-------------------------------|------------------------|------------------------|
| forward | y_e  = Q(x_e) @ Q(w_e)        | D (dim -1 of x)        | D (dim -2 of w_EDF)    |
| dgrad   | dx_e = Q(dy_e) @ Q(w_e)^T     | F (dim -1 of dy)       | F (dim -1 of w_EDF)    |
| wgrad   | dw_e = Q(x_e)^T @ Q(dy_e)     | tokens (dim 0), both   | -                      |

So x is quantised twice (rows for the forward, columns for wgrad) and so is dy; the backward saves the
unquantised x and w and requantises, as MX training recipes do.

Group-aware rule. The wgrad GEMM reduces over tokens, and a token block must never hold rows of two
experts: expert e's block would then share a scale with expert e+1's rows, and its weight gradient
would depend on another expert's activations. The routing plan therefore pads every expert's group to
a multiple of the token block (`plan_align`: lcm(cfg.align, block), set by the MoE layer), the padding
rows are zeros, and `quant_grouped_mm` raises ValueError when an offset is not a multiple of the
block. Everything is quantised per expert segment: scales are block-local in MX and fp8 blockwise, so
one `quantize` over the grouped region gives the same bits as a per-segment loop; NVFP4's per-tensor
scale is taken per expert segment (each expert's x_e, w_e, dy_e has its own fp32 tensor scale, as a
grouped kernel with one alpha per group, or TransformerEngine's GroupedLinear, does).

Recipes (`RECIPES`; the formats are `ops.quant`'s):

| precision     | x, dy: element, block, scale  | w: element, block, scale       | token block |
|---------------|-------------------------------|--------------------------------|-------------|
| mxfp8         | E4M3, 1x32, E8M0              | E4M3, 32 along the reduction   | 32          |
| fp8_blockwise | E4M3, 1x128, fp32             | E4M3, 128x128, fp32            | 128         |
| nvfp4         | E2M1, 1x16, E4M3 + fp32/tensor| E2M1, 16 along the reduction   | 16          |
| mxfp4         | E2M1, 1x32, E8M0              | E2M1, 32 along the reduction   | 32          |

* mxfp8 uses E4M3 for gradients too. The E5M2 convention comes from per-tensor FP8, where one scale
  had to cover a gradient's whole dynamic range; with a scale per 32 elements E4M3's extra mantissa
  bit is worth more than E5M2's range (NVIDIA's MXFP8 pretraining recipe and torchao's MX recipe do the
  same). Switching is a one-field change in `RECIPES` ("mxfp8_e5m2").
* fp8_blockwise follows DeepSeek-V3: activations and gradients in 1x128 tiles along the reduction dim,
  weights in 128x128 blocks. The blocks are square, so one quantisation of w serves both W (forward)
  and W^T (dgrad). For wgrad, x and dy are re-tiled 1x128 along tokens (DeepSeek's 128x1 tiles of the
  row-major tensors), which is why the plan pads expert groups to 128 rows.
* nvfp4 follows NVIDIA's NVFP4 pretraining recipe only in its encoding. Omitted, and documented in
  docs/low_precision.md: the 16x16 2-D weight blocks (so here w is requantised along F for dgrad, and
  W and W^T see slightly different numbers), the random Hadamard transform on the wgrad operands, and
  stochastic rounding of gradients (ops.quant rounds to nearest only). These change the noise, not the
  algebra; the parity test checks the encoding we do use.
* mxfp4 is E2M1 with E8M0 scales, blocks of 32 everywhere (gpt-oss stores its experts so).

Emulation. On every device the product is computed as `dequantize(quantize(.))` to fp32 (by
`quant.fake_quantize_fp32`, the same bits without building the bytes), then a plain fp32 matmul per
expert (the grouped-GEMM loop of `grouped_mm_reference`): the numbers a real block-scaled kernel
multiplies, accumulated in fp32, equal up to the summation order. The output and gradients are cast
back to the input dtypes (a real kernel writes bf16). Row operands are quantised in one call over the
grouped region [0, end) for every dim, wgrad's token dim included: the plan's alignment makes each
token block lie inside one expert, so the blocks are cut in place with no per-expert slicing (NVFP4
alone loops, for its per-expert tensor scale). The loop reads the offsets on the host (one sync per
GEMM); on CPU that costs microseconds, and the time goes to the elementwise passes of quantisation
and to fp32 matmuls. This path is for numerics, never for speed. A guarded `torch._scaled_grouped_mm`
path for CUDA is future work; no speed is claimed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .quant import FORMATS, fake_quantize_fp32


@dataclass(frozen=True)
class Recipe:
    """Which `ops.quant` format each operand uses, and the token block the plan must align to."""

    act: str  # x in the forward, x in wgrad (1-D blocks)
    grad: str  # dy in dgrad and wgrad (1-D blocks)
    weight: str  # w, forward and dgrad
    token_block: int  # rows per wgrad block: expert groups are padded to a multiple of this


RECIPES: dict[str, Recipe] = {
    "mxfp8": Recipe("mxfp8_e4m3", "mxfp8_e4m3", "mxfp8_e4m3", 32),
    "fp8_blockwise": Recipe("fp8_blockwise_act", "fp8_blockwise_act", "fp8_blockwise_weight", 128),
    "nvfp4": Recipe("nvfp4", "nvfp4", "nvfp4", 16),
    "mxfp4": Recipe("mxfp4", "mxfp4", "mxfp4", 32),
}
FULL_PRECISION = "bf16"  # the layer's name for "no quantisation"


def recipe(precision: str) -> Recipe:
    if precision not in RECIPES:
        raise ValueError(f"precision={precision!r}: unknown; expected {FULL_PRECISION!r} or one of "
                         f"{sorted(RECIPES)}")
    return RECIPES[precision]


def plan_align(precision: str, align: int) -> int:
    """Row alignment for the routing plan: `align` made a multiple of the format's token block."""
    if precision == FULL_PRECISION:
        return align
    return math.lcm(align, recipe(precision).token_block)


def check_widths(precision: str, d: int, f: int) -> None:
    """Raise ValueError unless both GEMM widths split into whole blocks (no padding is done here)."""
    r = recipe(precision)
    width_block = FORMATS[r.weight][1]  # 128 for fp8 blockwise weights, else the 1-D block
    for name, value in (("d", d), ("f", f)):
        if value % width_block:
            raise ValueError(f"precision={precision!r} needs {name} divisible by its block size "
                             f"{width_block}, got {name}={value}; pad the width to a multiple of {width_block}")


def _fq(x: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """The fp32 numbers a block-scaled GEMM multiplies: dequantize(quantize(x)), bit for bit."""
    return fake_quantize_fp32(x, fmt, dim)


def _has_tensor_scale(fmt: str) -> bool:
    return fmt == "nvfp4"


def _fq_weight(w_EDF: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """Fake-quantise every expert's weight; NVFP4's tensor scale is per expert."""
    if _has_tensor_scale(fmt):
        return torch.stack([_fq(w, fmt, dim) for w in w_EDF])
    return _fq(w_EDF, fmt, dim)


def _fq_rows(x_RD: torch.Tensor, fmt: str, dim: int, ends: list[int]) -> torch.Tensor:
    """Fake-quantise the grouped rows [0, ends[-1]) to fp32, per expert segment; rows past the last
    group (the plan's static slack) are left out. Without a tensor scale, one call over the whole
    region gives the per-segment bits, because the offsets are block-aligned and scales block-local."""
    end = ends[-1] if ends else 0
    if _has_tensor_scale(fmt):
        parts = [_fq(x_RD[s:e], fmt, dim) for s, e in zip([0] + ends[:-1], ends) if e > s]
        return torch.cat(parts) if parts else x_RD.new_zeros((0, x_RD.shape[1]), dtype=torch.float32)
    return _fq(x_RD[:end], fmt, dim)


def _check_offsets(ends: list[int], block: int, precision: str, num_rows: int) -> None:
    bad = [e for e in ends if e % block]
    if bad:
        raise ValueError(f"precision={precision!r}: expert group ends {bad} are not multiples of the "
                         f"token block {block}; a wgrad block would straddle two experts. Build the "
                         f"routing plan with align={block} (see quant_gemm.plan_align)")
    if ends and ends[-1] > num_rows:
        raise ValueError(f"offsets_E ends at {ends[-1]} but x_RD has only {num_rows} rows")


def _loop_mm(a_RX: torch.Tensor, b_EXY: torch.Tensor, ends: list[int], num_rows: int | None = None
             ) -> torch.Tensor:
    """y[s:e] = a[s:e] @ b[i] for each group; `num_rows` rows (default: a's), those past the last group
    zero. The grouped_mm_reference loop, fp32."""
    end = ends[-1] if ends else 0
    y = a_RX.new_empty(a_RX.shape[0] if num_rows is None else num_rows, b_EXY.shape[-1])
    y[end:] = 0  # the groups tile [0, end) exactly, so only the slack needs clearing
    for i, (s, e) in enumerate(zip([0] + ends[:-1], ends)):
        if e > s:
            y[s:e] = a_RX[s:e] @ b_EXY[i]
    return y


class _QuantGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, w_EDF: torch.Tensor, ends: list[int], precision: str,
                rows_exact: bool) -> torch.Tensor:
        r = RECIPES[precision]
        ctx.save_for_backward(x_RD, w_EDF)
        ctx.ends, ctx.recipe = ends, r
        # rows already exact in the act format along D (an MX payload's decode): Q(x) = x, skipped
        xq_RD = x_RD[:ends[-1] if ends else 0].float() if rows_exact else _fq_rows(x_RD, r.act, -1, ends)
        wq_EDF = _fq_weight(w_EDF, r.weight, -2)
        return _loop_mm(xq_RD, wq_EDF, ends, x_RD.shape[0]).to(x_RD.dtype)

    @staticmethod
    def backward(ctx, dy_RF: torch.Tensor):
        x_RD, w_EDF = ctx.saved_tensors
        ends, r = ctx.ends, ctx.recipe
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq_RF = _fq_rows(dy_RF, r.grad, -1, ends)
            wq_EFD = _fq_weight(w_EDF, r.weight, -1).transpose(-1, -2)
            dx = _loop_mm(dyq_RF, wq_EFD, ends, x_RD.shape[0]).to(x_RD.dtype)
        if ctx.needs_input_grad[1]:
            xq_RD = _fq_rows(x_RD, r.act, 0, ends)
            dyq_RF = _fq_rows(dy_RF, r.grad, 0, ends)
            dw_EDF = torch.zeros(w_EDF.shape, dtype=torch.float32, device=w_EDF.device)
            for i, (s, e) in enumerate(zip([0] + ends[:-1], ends)):
                if e > s:
                    dw_EDF[i] = xq_RD[s:e].T @ dyq_RF[s:e]
            dw = dw_EDF.to(w_EDF.dtype)
        return dx, dw, None, None, None


def quant_grouped_mm(x_RD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor,
                     precision: str, rows_format: str | None = None) -> torch.Tensor:
    """y_RF = Q(x) @ Q(w) per expert group, with the quantised dgrad and wgrad in backward.

    `rows_format`: the quant format x's rows are already exact in along D (ExpertBatch.rows_format:
    the decoded rows of an mxfp8 dispatch payload). When it is the recipe's activation format the
    forward takes them as they are: the same bits (MX rounding is idempotent,
    tests/ops/test_payload.py), one quantisation pass fewer. wgrad still quantises x along tokens.

    Raises ValueError for an unknown precision, widths that do not split into whole blocks, or group
    ends that are not multiples of the recipe's token block.
    """
    r = recipe(precision)
    check_widths(precision, w_EDF.shape[-2], w_EDF.shape[-1])
    ends = [int(e) for e in offsets_E.tolist()]  # host read: this is the emulation path
    _check_offsets(ends, r.token_block, precision, x_RD.shape[0])
    exact = rows_format is not None and rows_format == r.act and not _has_tensor_scale(r.act)
    return _QuantGroupedMM.apply(x_RD, w_EDF, ends, precision, exact)


def quant_grouped_mm_reference(x_RD: torch.Tensor, w_EDF: torch.Tensor, dy_RF: torch.Tensor,
                               offsets_E: torch.Tensor, precision: str
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The specification, one expert segment at a time: (y, dx, dw) in fp32 from the formulas in the
    module docstring, quantising every operand of segment e on its own."""
    r = recipe(precision)
    ends = [int(e) for e in offsets_E.tolist()]
    R, Fo = dy_RF.shape
    y = torch.zeros(R, Fo)
    dx = torch.zeros(R, x_RD.shape[1])
    dw = torch.zeros(w_EDF.shape)
    for i, (s, e) in enumerate(zip([0] + ends[:-1], ends)):
        if e == s:
            continue
        x, dy, w = x_RD[s:e], dy_RF[s:e], w_EDF[i]
        y[s:e] = _fq(x, r.act, -1) @ _fq(w, r.weight, 0)
        dx[s:e] = _fq(dy, r.grad, -1) @ _fq(w, r.weight, -1).T
        dw[i] = _fq(x, r.act, 0).T @ _fq(dy, r.grad, 0)
    return y, dx, dw
