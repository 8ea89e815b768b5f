"""Bit-level encoders for the narrow float formats used by `dropless.ops.quant`.

Everything here is elementwise and stateless, takes and returns plain tensors, and computes in fp32.
`quant.py` owns the blocking and the scale recipes; this file only knows how one number becomes bits.

Formats (the OCP MX v1.0 element and scale types, plus what torch gives us for free):

| name  | bits | exp bias | max normal | min subnormal | Inf | NaN          | torch dtype          |
|-------|------|----------|------------|---------------|-----|--------------|----------------------|
| E4M3  | 8    | 7        | 448        | 2^-9          | no  | S.1111.111   | float8_e4m3fn        |
| E5M2  | 8    | 15       | 57344      | 2^-16         | yes | IEEE-like    | float8_e5m2          |
| E2M1  | 4    | 1        | 6          | 0.5           | no  | no           | (ours: uint8 nibbles)|
| E8M0  | 8    | 127      | 2^127      | 2^-127        | no  | 0xFF         | float8_e8m0fnu       |

Rounding is round-to-nearest, ties-to-even (RNE) everywhere. Overflow saturates to the largest finite
value: that is what the MX spec asks for E4M3/E2M1 elements, and for E5M2 we choose it too, because an
Inf produced by rounding a finite input would poison a whole GEMM output row for one outlier. torch's
`.to(float8_*)` casts do RNE, but overflow differs by dtype and version (torch 2.13 on CPU saturates
E4M3 yet sends E5M2 inputs >= 61440 to Inf; other versions and devices have given NaN for E4M3), so we
always clamp first and never rely on the cast's overflow behaviour. NaN inputs are passed
through as NaN where the format has one; E2M1 has none, so callers carry NaN in the block scale.

E2M1 code layout: bit 3 is the sign, bits 0..2 index the magnitude table `E2M1_VALUES`. Two codes
share a byte, element 2i in the low nibble and element 2i+1 in the high nibble (the order NVIDIA and
torch's `float4_e2m1fn_x2` use), so packed storage is 4 bits per element.
"""

from __future__ import annotations

import torch

E4M3_MAX: float = 448.0
E5M2_MAX: float = 57344.0
E2M1_MAX: float = 6.0

# Largest unbiased exponent of each element format (emax_elem in the MX spec); the E8M0 scale is
# chosen as 2^(floor(log2(amax)) - emax_elem) so the block maximum lands in the element's top binade.
EMAX_ELEM: dict[str, int] = {"e4m3": 8, "e5m2": 15, "e2m1": 2}

E8M0_BIAS: int = 127
E8M0_NAN: int = 0xFF
E8M0_MIN_EXP: int = -127  # byte 0x00
E8M0_MAX_EXP: int = 127  # byte 0xFE

# Magnitudes of the 8 non-negative E2M1 codes: 0 and 0.5 are the subnormals (exponent field 0).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Midpoint between code i and code i+1. A magnitude exactly on a midpoint is a tie; RNE sends it to
# the code with an even mantissa bit, which in this table is the even code index.
_E2M1_MIDPOINTS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def has_e8m0_dtype() -> bool:
    """True where this torch has `float8_e8m0fnu` (2.7+); otherwise scales are kept as raw uint8."""
    return hasattr(torch, "float8_e8m0fnu")


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn with RNE, saturating to +-448; NaN stays NaN."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # clamp keeps NaN as NaN


def cast_e5m2(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e5m2 with RNE, saturating to +-57344 (no Inf from finite or infinite input)."""
    return x.clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 codes (uint8 in 0..15, one per element), RNE, saturating to +-6.

    NaN has no E2M1 encoding and is encoded as +0; the caller must flag it elsewhere (the block scale).
    """
    x = x.float()
    mag = x.abs().nan_to_num(nan=0.0).clamp(max=E2M1_MAX)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    tie_rounds_up = torch.arange(len(_E2M1_MIDPOINTS), device=x.device) % 2 == 1  # odd lower code
    above = mag.unsqueeze(-1) > mids  # (..., 7): strictly past midpoint i -> at least code i+1
    tie = (mag.unsqueeze(-1) == mids) & tie_rounds_up
    code = (above | tie).sum(dim=-1).to(torch.uint8)
    # Keep the sign of -0.0 and of tiny negatives that round to zero, as IEEE casts do; NaN gets +.
    sign = torch.signbit(x) & ~x.isnan()
    return code | (sign.to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) uint8 codes -> (..., n) bytes: even element in the low nibble, odd in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2n) uint8 codes; exact inverse of `pack_fp4`."""
    lo = packed & 0xF
    hi = (packed >> 4) & 0xF
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2(x)) as int32 for finite x > 0, subnormals included (frexp is exact; log2 is not
    guaranteed to be exact at powers of two and just below them)."""
    _, exp = torch.frexp(x.float())  # x = m * 2^exp with m in [0.5, 1)
    return exp.to(torch.int32) - 1


def e8m0_exponent_for(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """MX scale exponent for blocks with the given amax: floor(log2(amax)) - emax_elem, clamped to the
    E8M0 range. amax == 0 gives the smallest scale (the formula's -inf clamped), which is finite, so
    an all-zero block decodes to zeros. Non-finite amax is not handled here (see `encode_e8m0`)."""
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    exp = floor_log2(safe) - emax_elem
    exp = torch.where(amax > 0, exp, torch.full_like(exp, E8M0_MIN_EXP))
    return exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def encode_e8m0(exp: torch.Tensor, nan_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Unbiased int exponents in [-127, 127] -> E8M0 bytes (float8_e8m0fnu view, or uint8 where torch
    lacks that dtype). Positions in `nan_mask` get the NaN byte 0xFF."""
    byte = (exp.to(torch.int32) + E8M0_BIAS).to(torch.uint8)
    if nan_mask is not None:
        byte = torch.where(nan_mask, torch.full_like(byte, E8M0_NAN), byte)
    return byte.view(torch.float8_e8m0fnu) if has_e8m0_dtype() else byte


def pow2(exp: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^exp for int exponents in [-127, 127]. Built from the bit pattern rather than with
    exp2/ldexp so no libm rounding can creep in: biased exponent b in 1..254 with zero mantissa is
    2^(b-127); 2^-127 is the fp32 subnormal with only mantissa bit 22 set."""
    biased = exp.to(torch.int32) + E8M0_BIAS
    bits = torch.where(biased == 0, torch.full_like(biased, 1 << 22), biased << 23)
    return bits.view(torch.float32)


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(byte - 127), NaN for 0xFF."""
    byte = scale.view(torch.uint8).to(torch.int32)
    val = pow2(byte.clamp(max=E8M0_NAN - 1) - E8M0_BIAS)
    return torch.where(byte == E8M0_NAN, torch.full_like(val, float("nan")), val)
