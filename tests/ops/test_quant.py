"""Tests for dropless.ops.quant and its encoders in dropless.ops._fp_formats.

Most cases are hand-worked and bit-exact: the value to expect is derived in the comment beside each.
Random-data tests use SQNR floors (signal power / error power, in dB) from `SQNR_FLOOR_DB` below.
"""

from __future__ import annotations

import math

import pytest
import torch

from dropless.ops._fp_formats import (
    E2M1_VALUES,
    decode_e2m1,
    decode_e8m0,
    e8m0_exponent_for,
    encode_e2m1,
    encode_e8m0,
    pack_fp4,
    unpack_fp4,
)
from dropless.ops.quant import FORMATS, QTensor, dequantize, fake_quantize, fake_quantize_fp32, quantize

ROW_FORMATS = [f for f in FORMATS if f != "fp8_blockwise_weight"]  # blocked along one dim
NAN = float("nan")
INF = float("inf")

# Error floors for x ~ N(0, 1), shape (256, 1024), seed 0. A float with m mantissa bits has relative
# rounding error uniform in about +-2^-(m+1), i.e. an SQNR near 6.02 * m + 12 dB when values sit
# mid-range; block scaling puts every block near the top of the range, so that estimate holds, minus
# what the scale recipe costs. Measured (torch 2.13 CPU) in brackets; floors sit ~2 dB below so a
# different RNG stream passes but a real regression (one lost mantissa bit = 6 dB) fails.
SQNR_FLOOR_DB: dict[str, float] = {
    "mxfp8_e4m3": 28.5,  # [30.7] 3 mantissa bits; a power-of-two scale leaves amax anywhere in a binade
    "mxfp8_e5m2": 23.5,  # [25.4] 2 mantissa bits: ~6 dB under E4M3
    "mxfp4": 17.0,  # [18.8] 1 mantissa bit, 8 magnitudes; a power-of-two scale fits amax loosely
    "nvfp4": 18.5,  # [20.4] same elements, but blocks of 16 and a fine E4M3 scale fit amax to 6 closely
    "fp8_blockwise_act": 30.0,  # [31.8] E4M3 with an exact fp32 scale: amax maps to 448 exactly
    "fp8_blockwise_weight": 30.0,  # [31.6] as above; 128x128 blocks have larger amax, slightly worse
}


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return 10 * math.log10(x.pow(2).sum().item() / (y - x).pow(2).sum().item())


def _block(values: list[float], size: int) -> torch.Tensor:
    """One block of `size` elements: `values` first, zero-padded."""
    return torch.tensor(values + [0.0] * (size - len(values)))


def _mx_scale_exp(q: QTensor) -> torch.Tensor:
    return q.scale.view(torch.uint8).to(torch.int32) - 127


# ---------------------------------------------------------------- E2M1 / E8M0 encoders


def test_e2m1_rne_ties() -> None:
    # Each input is exactly halfway between two E2M1 values; RNE picks the one with an even mantissa
    # bit, which is the even index in (0, 0.5, 1, 1.5, 2, 3, 4, 6):
    # 0.25: 0 (idx 0) vs 0.5 (1) -> 0     0.75: 0.5 (1) vs 1 (2) -> 1     1.25: 1 (2) vs 1.5 (3) -> 1
    # 1.75: 1.5 (3) vs 2 (4) -> 2         2.5: 2 (4) vs 3 (5) -> 2        3.5: 3 (5) vs 4 (6) -> 4
    # 5: 4 (6) vs 6 (7) -> 4
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(decode_e2m1(encode_e2m1(x)), want)
    assert torch.equal(decode_e2m1(encode_e2m1(-x)), -want)  # sign-magnitude: ties are symmetric


def test_e2m1_nearest_and_saturation() -> None:
    # Off-tie values go to the nearest value; beyond 6 saturates (no Inf in E2M1); every table value is
    # a fixed point.
    x = torch.tensor([0.26, 0.74, 2.49, 2.51, 5.01, 6.5, 1e30, INF, -7.0])
    want = torch.tensor([0.5, 0.5, 2.0, 3.0, 6.0, 6.0, 6.0, 6.0, -6.0])
    assert torch.equal(decode_e2m1(encode_e2m1(x)), want)
    table = torch.tensor(E2M1_VALUES)
    assert torch.equal(decode_e2m1(encode_e2m1(table)), table)


def test_e2m1_all_codes_decode_and_reencode() -> None:
    # 16 codes: bit 3 is the sign. Re-encoding each decoded value gives the same code (both zeros too).
    codes = torch.arange(16, dtype=torch.uint8)
    vals = decode_e2m1(codes)
    assert torch.equal(vals[:8], torch.tensor(E2M1_VALUES))
    assert torch.equal(vals[8:], -torch.tensor(E2M1_VALUES))
    assert torch.equal(encode_e2m1(vals), codes)


def test_fp4_pack_unpack_round_trip() -> None:
    # Every byte unpacks to two codes and packs back; every code pair survives pack -> unpack; element
    # 2i lives in the low nibble.
    all_bytes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4(all_bytes)), all_bytes)
    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    pairs = torch.stack([lo.flatten(), hi.flatten()], dim=-1).to(torch.uint8)  # (256, 2)
    assert torch.equal(unpack_fp4(pack_fp4(pairs)), pairs)
    assert pack_fp4(torch.tensor([0x1, 0xF], dtype=torch.uint8)).item() == 0xF1


def test_e8m0_round_trip_against_torch() -> None:
    # All 255 finite exponents encode to byte e + 127 and decode to 2^e exactly; torch's own
    # float8_e8m0fnu -> float32 cast is the independent oracle. 0xFF is NaN.
    exp = torch.arange(-127, 128)
    enc = encode_e8m0(exp)
    assert torch.equal(enc.view(torch.uint8), torch.arange(0, 255, dtype=torch.uint8))
    assert torch.equal(decode_e8m0(enc), enc.float())
    assert torch.equal(decode_e8m0(enc), torch.exp2(exp.double()).float())
    assert decode_e8m0(encode_e8m0(exp[:1], nan_mask=torch.tensor([True]))).isnan().all()


def test_e8m0_exponent_selection() -> None:
    # floor(log2(amax)) - emax, exact at and just below powers of two; 0 -> smallest scale (-127); huge
    # and tiny amax clamp to the E8M0 range.
    amax = torch.tensor([448.0, 447.99, 512.0, 511.99, 1.0, 0.99999994, 0.0, 3e38, 2.0**-149])
    want = torch.tensor([0, 0, 1, 0, -8, -9, -127, 119, -127], dtype=torch.int32)
    assert torch.equal(e8m0_exponent_for(amax, emax_elem=8), want)


# ---------------------------------------------------------------- MX block scale selection


@pytest.mark.parametrize(
    ("fmt", "amax", "want_exp", "want_amax_out"),
    [
        # E4M3 (emax 8): 448 = 1.75 * 2^8 -> scale 2^0 and 448 is exact; 447.99 is in the same binade,
        # same scale, and RNE lands on 448 (E4M3 step is 32 in [256, 512)).
        ("mxfp8_e4m3", 448.0, 0, 448.0),
        ("mxfp8_e4m3", 447.99, 0, 448.0),
        # At a power of two the scale steps: 512 -> 2^1, 512/2 = 256 exact. Just below, 511.99 keeps
        # scale 2^0 and 511.99 > 448 saturates: the spec's floor(log2) choice clips the top binade.
        ("mxfp8_e4m3", 512.0, 1, 512.0),
        ("mxfp8_e4m3", 511.99, 0, 448.0),
        # E2M1 (emax 2): 6 = 1.5 * 2^2 -> scale 1, exact; 5.99 -> same scale, RNE to 6 (midpoint is 5).
        ("mxfp4", 6.0, 0, 6.0),
        ("mxfp4", 5.99, 0, 6.0),
        # 4 -> scale 1, exact; 3.99 drops a binade to scale 1/2, 7.98 saturates to 6, so 3.99 -> 3.
        ("mxfp4", 4.0, 0, 4.0),
        ("mxfp4", 3.99, -1, 3.0),
        # E5M2 (emax 15): 65535 -> scale 1, and 65535 > 57344 saturates (an unclamped cast gives Inf).
        ("mxfp8_e5m2", 65535.0, 0, 57344.0),
        ("mxfp8_e5m2", 65536.0, 1, 65536.0),
    ],
)
def test_mx_scale_at_and_below_power_of_two(
    fmt: str, amax: float, want_exp: int, want_amax_out: float
) -> None:
    x = _block([amax, -1.0], 32)
    q = quantize(x, fmt)
    assert _mx_scale_exp(q).tolist() == [want_exp]
    y = dequantize(q)
    assert y[0].item() == want_amax_out
    assert y[1].item() == -1.0  # 1 is exact in every element format at these scales


def test_saturation_above_max_times_scale() -> None:
    # Block amax 500 -> E4M3 scale 2^0; 500 and 480 exceed 448 * 1 and clamp to 448 with sign kept.
    x = _block([500.0, -480.0, 3.0], 32)
    assert fake_quantize(x, "mxfp8_e4m3")[:3].tolist() == [448.0, -448.0, 3.0]
    # E5M2 (amax 62000 -> scale 2^0): the neighbours of 62000 are 57344 and 2^16, which is already the
    # Inf encoding; IEEE RNE sends anything >= the midpoint 61440 to Inf. We clamp to 57344 instead.
    x = _block([62000.0, -62000.0], 32)
    assert fake_quantize(x, "mxfp8_e5m2")[:2].tolist() == [57344.0, -57344.0]
    # E2M1: amax 7.9 -> scale 1 (floor(log2 7.9) = 2); 7.9 and 6.5 clamp to 6.
    x = _block([7.9, -6.5, 1.5], 32)
    assert fake_quantize(x, "mxfp4")[:3].tolist() == [6.0, -6.0, 1.5]


def test_subnormal_elements_exact() -> None:
    # Scale 2^0 (amax 448). E4M3's smallest subnormal 2^-9 is exact; 2^-10 is a tie between 0 and
    # 2^-9 and RNE picks 0 (even mantissa 000); 3 * 2^-10 is a tie between 2^-9 (mantissa 001) and
    # 2^-8 (010) and RNE picks 2^-8.
    x = _block([448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10], 32)
    assert fake_quantize(x, "mxfp8_e4m3")[:4].tolist() == [448.0, 2.0**-9, 0.0, 2.0**-8]
    # E2M1 at scale 1 (amax 6): 0.5 is its only subnormal, exact; 0.25 ties to 0.
    x = _block([6.0, 0.5, -0.5, 0.25], 32)
    assert fake_quantize(x, "mxfp4")[:4].tolist() == [6.0, 0.5, -0.5, 0.0]


# ---------------------------------------------------------------- NVFP4 / FP8 blockwise hand cases


def test_nvfp4_two_level_scale() -> None:
    # Tensor amax 6 -> global scale 6 / (448 * 6) = 1/448. Block 0 (amax 6) -> E4M3 scale 448; block 1
    # (amax 3) -> 224, both exact in E4M3. The fp32 global scale 1/448 is not a power of two, so the
    # product scale * global is 1 (or 1/2) only to within an fp32 ulp: compare to 1e-6 relative.
    x = torch.cat([_block([6.0, -1.5, 0.5], 16), _block([3.0, 0.75, -0.25], 16)])
    q = quantize(x, "nvfp4")
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.float().tolist() == [448.0, 224.0]
    assert q.global_scale is not None and q.global_scale.item() == pytest.approx(1 / 448, rel=1e-7)
    want = torch.cat([_block([6.0, -1.5, 0.5], 16), _block([3.0, 0.75, -0.25], 16)])
    torch.testing.assert_close(dequantize(q), want, rtol=1e-6, atol=0)


def test_fp8_blockwise_scales() -> None:
    # Activation tile of 128 with amax 896 -> fp32 scale 896 / 448 = 2; 896 -> 448 -> 896 exact, and
    # 3 -> 1.5 (exact in E4M3) -> 3.
    x = _block([896.0, 3.0], 128)
    q = quantize(x, "fp8_blockwise_act")
    assert q.scale.tolist() == [2.0]
    assert fake_quantize(x, "fp8_blockwise_act")[:2].tolist() == [896.0, 3.0]
    # Weight: an outlier in block (0, 1) of a 256x256 matrix changes only that block's scale.
    w = torch.ones(256, 256)
    w[5, 200] = 448.0 * 4
    qw = quantize(w, "fp8_blockwise_weight")
    assert qw.scale.shape == (2, 2)
    inv = torch.tensor(1.0) / 448  # fp32 1/448, what amax / 448 gives for amax 1
    assert torch.equal(qw.scale, torch.stack([torch.stack([inv, torch.tensor(4.0)]), inv.expand(2)]))
    assert torch.equal(dequantize(qw), w)  # 1/448 * 448 rounds to exactly 1 in fp32; 4 * 448 exact


# ---------------------------------------------------------------- zeros, NaN, Inf


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_all_zero_blocks(fmt: str) -> None:
    # An all-zero tensor must give finite scales (no 0/0) and decode to exact zeros. -0.0 keeps its
    # sign through E4M3/E5M2/E2M1.
    x = torch.zeros(128, 256)
    x[0, 0] = -0.0
    q = quantize(x, fmt)
    assert torch.isfinite(q.scale.float()).all()
    y = dequantize(q)
    assert torch.equal(y, x) and torch.signbit(y[0, 0])


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_poisons_only_its_block(fmt: str, bad: float) -> None:
    # Documented behaviour: NaN or +-Inf anywhere in a block makes that block's scale NaN, so the whole
    # block dequantises to NaN (Inf included: E4M3/E2M1 cannot hold it, and saturating it would hide an
    # overflow). Every other block is bit-identical to quantising with the bad block zeroed, which also
    # shows NVFP4's per-tensor amax ignores the non-finite value.
    torch.manual_seed(0)
    x = torch.randn(256, 256)
    x[3, 5] = bad
    y = fake_quantize(x, fmt)
    in_block = torch.zeros_like(x, dtype=torch.bool)
    if fmt == "fp8_blockwise_weight":
        in_block[:128, :128] = True
    else:
        in_block[3, : FORMATS[fmt][1]] = True  # x[3, 5] is in the first block of row 3
    assert y[in_block].isnan().all()
    clean = torch.where(in_block, 0.0, x)
    assert torch.equal(y[~in_block], fake_quantize(clean, fmt)[~in_block])


def test_nan_scale_bytes() -> None:
    # The NaN marker is the format's own NaN: E8M0 0xFF for MX, E4M3 NaN for NVFP4, fp32 NaN else.
    x = _block([1.0, NAN], 32)
    assert quantize(x, "mxfp4").scale.view(torch.uint8).tolist() == [0xFF]
    assert quantize(x, "nvfp4").scale.float()[0].isnan()
    assert quantize(_block([NAN], 128), "fp8_blockwise_act").scale.isnan().all()


# ---------------------------------------------------------------- layout, dims, dtypes


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sqnr_floor_random_normal(fmt: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 1024)
    assert _sqnr_db(x, fake_quantize(x, fmt)) > SQNR_FLOOR_DB[fmt]


@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_dim0_matches_transposed_dim_last(fmt: str) -> None:
    # The grouped GEMMs quantise each operand along its own reduction dim, which is dim 0 for some
    # operands. Blocking along dim 0 must give the same bytes as blocking the transpose along dim -1.
    torch.manual_seed(0)
    x = torch.randn(128, 96) * 10
    q0, q1 = quantize(x, fmt, dim=0), quantize(x.t().contiguous(), fmt, dim=-1)
    assert q0.dim == 0 and q0.scale.shape == (128 // FORMATS[fmt][1], 96)
    assert torch.equal(q0.data.view(torch.uint8), q1.data.t().view(torch.uint8))
    assert torch.equal(q0.scale.float(), q1.scale.t().float())
    assert torch.equal(dequantize(q0), dequantize(q1).t())


@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_middle_dim_of_3d_tensor(fmt: str) -> None:
    # (E, K, N) expert weights blocked along K (dim 1): same as moving K last and blocking there.
    torch.manual_seed(0)
    w = torch.randn(3, 128, 20)
    y = fake_quantize(w, fmt, dim=1)
    assert torch.equal(y, fake_quantize(w.transpose(1, 2), fmt, dim=-1).transpose(1, 2))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_shapes_dtypes_and_empty(fmt: str) -> None:
    # Storage dtypes are what kernels consume; fake_quantize keeps the input dtype; an empty expert
    # (zero rows) quantises to empty tensors without tripping over amax of nothing.
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    if fmt == "fp8_blockwise_weight":
        x = torch.randn(256, 256, dtype=torch.bfloat16)
    q = quantize(x, fmt)
    elem = FORMATS[fmt][0]
    want_data = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.uint8}[elem]
    assert q.data.dtype == want_data and q.shape == x.shape
    if elem == "e2m1":
        assert q.data.shape == (x.shape[0], x.shape[1] // 2)  # 4 bits per element
    assert fake_quantize(x, fmt).dtype == torch.bfloat16
    assert torch.equal(fake_quantize(x, fmt), dequantize(q, torch.bfloat16))
    empty = torch.zeros(0, 256)
    assert fake_quantize(empty, fmt).shape == (0, 256)


# ---------------------------------------------------------------- errors


def test_errors_name_the_value() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="mxfp6"):
        quantize(x, "mxfp6")
    with pytest.raises(ValueError, match=r"divisible by the block size 32.*size 48.*pad"):
        quantize(torch.randn(4, 48), "mxfp8_e4m3")
    with pytest.raises(ValueError, match=r"block size 16.*size 4.*pad"):
        quantize(x, "nvfp4", dim=0)
    with pytest.raises(ValueError, match=r"last two dims divisible by 128.*\(128, 200\)"):
        quantize(torch.randn(128, 200), "fp8_blockwise_weight")
    with pytest.raises(ValueError, match=r"\(256,\)"):
        quantize(torch.randn(256), "fp8_blockwise_weight")
    with pytest.raises(ValueError, match="dim=2"):
        quantize(x, "mxfp4", dim=2)
    with pytest.raises(ValueError, match="int64"):
        quantize(torch.ones(4, 64, dtype=torch.int64), "mxfp4")


def _awkward(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Values that exercise every branch of a block quantiser: a wide dynamic range (subnormal scales,
    saturation), exact E2M1 grid points and midpoints (ties to even), signed zeros, all-zero blocks,
    and non-finite blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 4)
    x[8:16] = 0.25 * torch.randint(-24, 25, (8, shape[1]), generator=g)  # 0.25 steps: grid + midpoints
    x[200:] = 0.0
    x[201, 3] = -0.0
    x[0, 1], x[5, 130], x[130, 7] = NAN, INF, -INF
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fake_quantize_fp32_is_bit_exact(fmt: str, dim: int, dtype: torch.dtype) -> None:
    # The emulation's fast path against the specification, bit for bit (NaNs compared by position,
    # zeros by sign). dim=0 is the wgrad direction, cut in place rather than transposed.
    x = _awkward((256, 384), seed=0).to(dtype)
    got = fake_quantize_fp32(x, fmt, dim)
    ref = dequantize(quantize(x, fmt, dim), torch.float32)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0))
    assert torch.equal(torch.signbit(got), torch.signbit(ref))


def test_fake_quantize_fp32_middle_dim_and_empty() -> None:
    w = _awkward((256, 384), seed=1).reshape(2, 128, 384)  # blocks along dim 1 of a 3-d tensor
    for fmt in ROW_FORMATS:
        assert torch.equal(fake_quantize_fp32(w, fmt, 1).nan_to_num(0.0),
                           dequantize(quantize(w, fmt, 1)).nan_to_num(0.0))
        assert fake_quantize_fp32(torch.zeros(0, 256), fmt).shape == (0, 256)
