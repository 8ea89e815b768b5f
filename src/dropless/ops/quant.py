"""Quantise / dequantise for low-precision expert GEMMs (mission section 6).

Design note
-----------
Expert GEMMs run in 8 or 4 bits; the router, norms, embeddings and optimizer state do not. A low-bit
GEMM needs each operand cut into blocks along its *reduction* dim, each block carrying one scale, so
that the GEMM can apply the scale once per block and accumulate in fp32. This file is the plain-PyTorch
specification of those encodings: `quantize` produces exactly the bytes a kernel would consume,
`dequantize` turns them back into numbers, and `fake_quantize` (the pair, in the input dtype) is the CPU
emulation that the grouped GEMM uses when no low-precision kernel is present.

Formats (`fmt`), all blocked along `dim` unless noted:

| fmt                   | element | block                   | scale                         | bits/elem |
|-----------------------|---------|-------------------------|-------------------------------|-----------|
| mxfp8_e4m3            | E4M3    | 32                      | E8M0 (power of two)           | 8.25      |
| mxfp8_e5m2            | E5M2    | 32                      | E8M0                          | 8.25      |
| mxfp4                 | E2M1    | 32                      | E8M0                          | 4.25      |
| nvfp4                 | E2M1    | 16                      | E4M3/block, one fp32/tensor   | 4.5       |
| fp8_blockwise_act     | E4M3    | 1x128                   | fp32 = amax / 448             | 8.25      |
| fp8_blockwise_weight  | E4M3    | 128x128, last two dims  | fp32 = amax / 448             | ~8        |

(`dim` is ignored for fp8_blockwise_weight.)

Scale choice.
* MX (OCP MX v1.0): scale = 2^(floor(log2(amax)) - emax_elem), emax_elem = 8 (E4M3), 15 (E5M2),
  2 (E2M1). This puts amax in the element format's top binade, [2^emax, 2^(emax+1)). A power-of-two
  scale is exact to apply and to invert, but the top binade reaches beyond the format's max (448 < 512,
  57344 < 65536, 6 < 8), so a block whose amax has a large mantissa saturates its largest elements:
  amax = 511 in E4M3 stores 448. That clipping is the spec's trade for a 1-byte scale. floor(log2) is
  taken exactly from the fp32 exponent bits (frexp), never from a rounded log2.
* NVFP4: per-tensor s_t = amax_tensor / (448 * 6), per-block s_b = E4M3(amax_block / 6 / s_t). s_t
  maps the largest block scale to the top of E4M3's range, so the E4M3 scale's 3 mantissa bits are
  spent on the ratio between blocks; elements are x / (s_b * s_t). The block scale is rounded, so an
  element can land a little above 6 and saturates there.
* FP8 blockwise (DeepSeek-V3): s = amax / 448 in fp32, so amax maps to 448 up to one fp32 rounding
  (clamped if it lands a hair above) and no binade is wasted. Activations use 1x128 tiles along the
  reduction dim; weights use 128x128 blocks, which are square, so the same scales serve W in the
  forward GEMM and W^T in the backward one without requantising.

Rounding: round-to-nearest, ties-to-even for elements and for the NVFP4 E4M3 scale; fp32 arithmetic
throughout (the input is upcast first). Saturation: out-of-range elements clamp to +-max of their
format before the cast, for E5M2 too (see `_fp_formats`); we never rely on torch's cast overflow rules.

Special values.
* Zero: an all-zero block gets a finite scale (MX: the smallest, 2^-127, the formula's -inf clamped;
  NVFP4 / blockwise: 0) and decodes to exact zeros. Signed zero survives for E4M3/E5M2/E2M1 elements.
* NaN or Inf anywhere in a block: that block's scale is NaN (E8M0 0xFF, E4M3 NaN, or fp32 NaN) and its
  elements are stored as 0, so the *whole block* dequantises to NaN. In MX a NaN scale (0xFF) decodes
  its whole block to NaN, and E2M1 has no NaN of its own, so the scale is the only place a NaN can
  live; we use the same carrier in every format. Inf is treated alike because E4M3/E2M1 cannot hold
  it and silently saturating an Inf to 448 * scale would hide an overflow. A non-finite value in an
  expert GEMM is a bug upstream, and NaN-ing its block (never the whole tensor) keeps it loud and
  local. NVFP4's per-tensor amax ignores non-finite values for the same reason.
* Tiny values: below half the element format's smallest subnormal (after scaling) they round to 0.
  MX scales clamp at 2^-127, so an E4M3 block with amax under 2^-137 (half of 2^-127 * 2^-9) flushes to
  zero. NVFP4 flushes a block whose E4M3 scale underflows (amax_block below ~2^-10 * 6 * s_t).

Layout. `data` keeps x's shape (fp8 formats) or halves `dim` (fp4: two E2M1 codes per byte, element 2i
in the low nibble). `scale` has x's shape with `dim` divided by the block (weights: the last two dims
divided by 128). Blocks never cross the end of `dim`; they do not know about experts, so quantising
along a token dim (dim=0, e.g. for the weight-gradient GEMM) must be done per expert segment or on
segments padded to the block size, otherwise one block would straddle two experts' rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._fp_formats import (
    E2M1_MAX,
    E4M3_MAX,
    EMAX_ELEM,
    cast_e4m3,
    cast_e5m2,
    decode_e2m1,
    decode_e8m0,
    e8m0_exponent_for,
    encode_e2m1,
    encode_e8m0,
    pack_fp4,
    pow2,
    unpack_fp4,
)

# fmt -> (element format, block size along `dim`)
FORMATS: dict[str, tuple[str, int]] = {
    "mxfp8_e4m3": ("e4m3", 32),
    "mxfp8_e5m2": ("e5m2", 32),
    "mxfp4": ("e2m1", 32),
    "nvfp4": ("e2m1", 16),
    "fp8_blockwise_act": ("e4m3", 128),
    "fp8_blockwise_weight": ("e4m3", 128),
}
WEIGHT_BLOCK: int = 128
_NVFP4_TENSOR_DIVISOR: float = E4M3_MAX * E2M1_MAX  # 448 * 6: the largest block scale maps to 448


@dataclass(frozen=True)
class QTensor:
    """A quantised tensor: the bytes a low-precision GEMM consumes, plus how to read them.

    data: float8_e4m3fn / float8_e5m2 (x's shape), or uint8 with two E2M1 codes per byte (x's shape
        with `dim` halved).
    scale: per-block scale, x's shape with `dim` // block (weights: last two dims // 128). dtype is
        float8_e8m0fnu for MX (uint8 exponent bytes on torch without it), float8_e4m3fn for NVFP4,
        float32 for fp8 blockwise.
    global_scale: NVFP4's per-tensor fp32 scale (0-dim tensor); None otherwise.
    fmt, shape, dim (non-negative), block: how it was cut.
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    fmt: str
    shape: torch.Size
    dim: int
    block: int


def _check(x: torch.Tensor, fmt: str, dim: int) -> int:
    """Validate the arguments; return `dim` made non-negative."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantisation format fmt={fmt!r}; expected one of {sorted(FORMATS)}")
    if not x.is_floating_point():
        raise ValueError(f"quantize needs a floating-point tensor, got dtype={x.dtype}")
    if fmt == "fp8_blockwise_weight":
        if x.dim() < 2 or x.shape[-1] % WEIGHT_BLOCK or x.shape[-2] % WEIGHT_BLOCK:
            raise ValueError(
                f"fmt='fp8_blockwise_weight' needs the last two dims divisible by {WEIGHT_BLOCK}, got "
                f"shape={tuple(x.shape)}; pad the weight to a multiple of {WEIGHT_BLOCK}"
            )
        return x.dim() - 1
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} out of range for a tensor of shape {tuple(x.shape)}")
    dim = dim % x.dim()
    block = FORMATS[fmt][1]
    if x.shape[dim] % block:
        raise ValueError(
            f"fmt={fmt!r} needs size along dim={dim} divisible by the block size {block}, got "
            f"shape={tuple(x.shape)} (size {x.shape[dim]}); pad dim {dim} to a multiple of {block}"
        )
    return dim


def _cast_elements(scaled: torch.Tensor, elem: str) -> torch.Tensor:
    """fp32 values already divided by their scale -> element storage (fp4 still unpacked codes)."""
    if elem == "e4m3":
        return cast_e4m3(scaled)
    if elem == "e5m2":
        return cast_e5m2(scaled)
    return encode_e2m1(scaled)


def quantize(x: torch.Tensor, fmt: str, dim: int = -1) -> QTensor:
    """Quantise `x` to `fmt`, with blocks running along `dim` (the operand's reduction dim)."""
    dim = _check(x, fmt, dim)
    if fmt == "fp8_blockwise_weight":
        return _quantize_weight(x)
    elem, block = FORMATS[fmt]
    x_last = x.float().movedim(dim, -1)  # (..., D): blocked dim last
    x_blk = x_last.reshape(*x_last.shape[:-1], x_last.shape[-1] // block, block)  # (..., D/block, block)
    bad = ~torch.isfinite(x_blk).all(dim=-1, keepdim=True)  # (..., D/block, 1): NaN/Inf in block
    amax = torch.where(bad, 0.0, x_blk.abs()).amax(dim=-1, keepdim=True)  # (..., D/block, 1)

    global_scale: torch.Tensor | None = None
    if fmt.startswith("mx"):
        exp = e8m0_exponent_for(amax, EMAX_ELEM[elem])
        scale = encode_e8m0(exp, nan_mask=bad)
        scaled = x_blk * pow2(-exp)  # exact: multiply by 2^-e, e in [-127, 127]
    elif fmt == "nvfp4":
        amax_t = amax.max() if amax.numel() else amax.new_zeros(())
        global_scale = torch.where(amax_t > 0, amax_t / _NVFP4_TENSOR_DIVISOR, 1.0)
        scale = cast_e4m3(torch.where(bad, float("nan"), amax / E2M1_MAX / global_scale))
        denom = scale.float() * global_scale
        scaled = torch.where(denom > 0, x_blk / denom, x_blk)  # zero scale: block is all +-0
    else:  # fp8_blockwise_act
        scale = torch.where(bad, float("nan"), amax / E4M3_MAX)
        scaled = torch.where(scale > 0, x_blk / scale, x_blk)  # zero scale: block is all +-0

    scaled = torch.where(bad, 0.0, scaled)  # the NaN scale alone marks a non-finite block
    data = _cast_elements(scaled, elem).reshape(x_last.shape)  # (..., D)
    if elem == "e2m1":
        data = pack_fp4(data)  # (..., D/2)
    return QTensor(
        data=data.movedim(-1, dim),
        scale=scale.squeeze(-1).movedim(-1, dim),
        global_scale=global_scale,
        fmt=fmt,
        shape=x.shape,
        dim=dim,
        block=block,
    )


def _quantize_weight(w: torch.Tensor) -> QTensor:
    """DeepSeek-V3 weight blocks: 128x128 tiles over the last two dims, fp32 scale amax / 448."""
    *lead, m, n = w.shape
    b = WEIGHT_BLOCK
    w_blk = w.float().reshape(*lead, m // b, b, n // b, b)  # (..., M/b, b, N/b, b)
    bad = ~torch.isfinite(w_blk).all(dim=-1, keepdim=True).all(dim=-3, keepdim=True)
    amax = torch.where(bad, 0.0, w_blk.abs()).amax(dim=(-3, -1), keepdim=True)  # (..., M/b, 1, N/b, 1)
    scale = torch.where(bad, float("nan"), amax / E4M3_MAX)
    scaled = torch.where(bad, 0.0, torch.where(scale > 0, w_blk / scale, w_blk))
    return QTensor(
        data=cast_e4m3(scaled).reshape(w.shape),
        scale=scale.reshape(*lead, m // b, n // b),
        global_scale=None,
        fmt="fp8_blockwise_weight",
        shape=w.shape,
        dim=w.dim() - 1,
        block=b,
    )


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize`: element * block scale (* tensor scale) in fp32, then cast to `dtype`."""
    if q.fmt not in FORMATS:
        raise ValueError(f"unknown quantisation format fmt={q.fmt!r}; expected one of {sorted(FORMATS)}")
    if q.fmt == "fp8_blockwise_weight":
        *lead, m, n = q.shape
        b = q.block
        vals = q.data.float().reshape(*lead, m // b, b, n // b, b)
        scale = q.scale.reshape(*lead, m // b, 1, n // b, 1)
        return (vals * scale).reshape(q.shape).to(dtype)

    elem, block = FORMATS[q.fmt]
    data_last = q.data.movedim(q.dim, -1)  # (..., D) or (..., D/2) packed
    vals = decode_e2m1(unpack_fp4(data_last)) if elem == "e2m1" else data_last.float()  # (..., D)
    vals = vals.reshape(*vals.shape[:-1], vals.shape[-1] // block, block)  # (..., D/block, block)
    scale_last = q.scale.movedim(q.dim, -1).unsqueeze(-1)  # (..., D/block, 1)
    if q.fmt.startswith("mx"):
        out = vals * decode_e8m0(scale_last)
    elif q.fmt == "nvfp4":
        assert q.global_scale is not None, "nvfp4 QTensor without its per-tensor scale"
        out = vals * scale_last.float() * q.global_scale
    else:
        out = vals * scale_last
    return out.flatten(-2).movedim(-1, q.dim).to(dtype)


def fake_quantize(x: torch.Tensor, fmt: str, dim: int = -1) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: the numbers a low-precision GEMM would see, anywhere."""
    return dequantize(quantize(x, fmt, dim), dtype=x.dtype)


def fake_quantize_fp32(x: torch.Tensor, fmt: str, dim: int = -1) -> torch.Tensor:
    """`dequantize(quantize(x, fmt, dim))` in fp32, bit for bit, computed without the bytes.

    The training emulation's hot path (ops.quant_gemm): it skips what only storage needs (E8M0 and
    E2M1 codes, fp4 packing, moving `dim` last) and the full-size passes that find and zero
    non-finite blocks. Exactness rests on four facts:
    * blocks are cut in place, `dim` split into (n, block), so no transposed copy is made;
    * `amax` propagates NaN and Inf, so a non-finite block is found from its (small) amax alone and
      gets a NaN scale, which turns the whole block to NaN as `dequantize` of a NaN scale does;
    * dividing by a safe scale (1 where the scale is 0 or NaN) equals the reference's
      `where(scale > 0, x / scale, x)`;
    * E2M1 round-to-nearest-even is rounding |x| / step with step 0.5 below 2, 1 below 4, 2 above
      (the grid 0, .5, 1, 1.5, 2, 3, 4, 6), and the even multiple of the step is the even code.
    `fake_quantize` stays the reference; tests/ops/test_quant.py compares the two bit for bit.
    """
    dim = _check(x, fmt, dim)
    if fmt == "fp8_blockwise_weight":  # weights are small next to the rows: no fast path needed
        return dequantize(_quantize_weight(x), torch.float32)
    elem, block = FORMATS[fmt]
    shape = x.shape
    x_blk = x.float().reshape(*shape[:dim], shape[dim] // block, block, *shape[dim + 1:])
    bdim = dim + 1  # the dim inside one block
    amax = x_blk.abs().amax(dim=bdim, keepdim=True)  # NaN/Inf propagate: the block is non-finite
    bad = ~torch.isfinite(amax)
    amax = torch.where(bad, 0.0, amax)
    nan = float("nan")

    if fmt.startswith("mx"):
        exp = e8m0_exponent_for(amax, EMAX_ELEM[elem])
        scaled = x_blk * pow2(-exp)
        scale = torch.where(bad, nan, pow2(exp))
        return (_round_elements(scaled, elem) * scale).reshape(shape)
    if fmt == "nvfp4":
        amax_t = amax.max() if amax.numel() else amax.new_zeros(())
        global_scale = torch.where(amax_t > 0, amax_t / _NVFP4_TENSOR_DIVISOR, 1.0)
        scale = cast_e4m3(torch.where(bad, nan, amax / E2M1_MAX / global_scale)).float()
        denom = scale * global_scale
        scaled = x_blk / torch.where(denom > 0, denom, 1.0)
        return (_round_elements(scaled, elem) * scale * global_scale).reshape(shape)
    scale = torch.where(bad, nan, amax / E4M3_MAX)  # fp8_blockwise_act
    scaled = x_blk / torch.where(scale > 0, scale, 1.0)
    return (_round_elements(scaled, elem) * scale).reshape(shape)


def _round_elements(scaled: torch.Tensor, elem: str) -> torch.Tensor:
    """fp32 values already divided by their scale -> the element format's value, as fp32."""
    if elem != "e2m1":
        return _cast_elements(scaled, elem).float()
    mag = scaled.abs().clamp(max=E2M1_MAX)
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return torch.copysign(torch.round(mag / step) * step, scaled)  # exact: step is a power of two
