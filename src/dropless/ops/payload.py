"""Token rows on the wire: the dispatch payload's encodings (`parallel.dispatch_dtype`).

Legend: N rows, D model width, W bytes per packed row.

The expert-parallel dispatch sends every routed token row to the ranks that hold its experts; with
top-k routing that is most of an MoE layer's traffic. A payload encoding quantises each row once, at
the source, in the block layout the low-precision expert GEMMs consume (ops/quant_gemm.py: 1x32
E4M3 blocks with an E8M0 scale for mxfp8, 1x128 E4M3 tiles with an fp32 scale for fp8 blockwise),
sends the codes and scales as one uint8 row, and decodes them at the destination into the rows'
own dtype. What the experts receive is then exactly `fake(x)`: the numbers an `fmt` GEMM would see.

| payload         | on the wire                                   | bytes per row (D = 1024) |
|-----------------|-----------------------------------------------|--------------------------|
| `native`        | the rows as they are (bf16 or fp32)           | 2048 / 4096              |
| `bf16`          | rows rounded to bf16 (fp32 rows halve)        | 2048                     |
| `mxfp8`         | E4M3 codes + one E8M0 byte per 32             | 1056 (0.516 of bf16)     |
| `fp8_blockwise` | E4M3 codes + one fp32 scale per 128           | 1056                     |

Widths that are not a multiple of the block get a last, shorter block (the row is zero-padded to
the block for the encoding; zeros change no block's amax, and the padding is cut off on decode).

Why the result is bit-identical for mxfp8 experts: an MX scale is 2^(floor(log2(amax)) - 8), which
puts amax/scale in [256, 512); rounding and saturation keep the decoded amax in [256, 448] times the
same scale, so quantising a decoded row again picks the same scale and the same codes (tests/ops/
test_payload.py checks it on random and edge rows). The experts' own quantisation of their input is
therefore a no-op on a received row. fp8 blockwise is not idempotent to the bit (its fp32 scale
amax/448, recomputed from 448 * scale, can move by one ulp), so there the experts requantise.
Decoded values are exact in bf16 (3 mantissa bits, fp32's exponent range) down to 2^-133; a block
whose amax is below about 2^-124 loses its smallest elements to bf16's subnormal floor.

Gradients: the encoding is rounding, and its backward is the identity (straight-through, as for
every quantised operand in ops/quant_gemm.py); the EP backward sends a received row's gradient back
in bf16 (distributed/comm.py), and `round_rows`, the one-process form, rounds it to bf16 alike. NaN and Inf survive as the block's NaN scale (ops/quant.py): a non-finite row
block arrives as NaN, never as a finite number.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._fp_formats import E4M3_MAX, EMAX_ELEM, decode_e8m0, e8m0_exponent_for, encode_e8m0, pow2

PAYLOADS = ("native", "bf16", "mxfp8", "fp8_blockwise")
# payload -> (ops.quant format, block, bytes per scale)
_CODES = {"mxfp8": ("mxfp8_e4m3", 32, 1), "fp8_blockwise": ("fp8_blockwise_act", 128, 4)}


def check(payload: str) -> None:
    if payload not in PAYLOADS:
        raise ValueError(f"dispatch_dtype={payload!r}: must be one of {', '.join(PAYLOADS)}")


def exact_format(payload: str) -> str | None:
    """The ops.quant format the decoded rows are exact in along their width (quantising them again
    in it changes no bit), or None. mxfp8 only: its power-of-two scales make MX rounding idempotent;
    fp8 blockwise's fp32 scale amax/448 promises no such thing."""
    return _CODES["mxfp8"][0] if payload == "mxfp8" else None


def is_coded(payload: str) -> bool:
    """True when rows travel as uint8 codes and scales (not as floats)."""
    return payload in _CODES


def row_bytes(payload: str, D: int, dtype: torch.dtype) -> int:
    """Bytes one row of width D takes on the wire."""
    check(payload)
    if payload == "native":
        return D * dtype.itemsize
    if payload == "bf16":
        return D * 2
    _, block, scale_bytes = _CODES[payload]
    return D + math.ceil(D / block) * scale_bytes


def wire_dtype(payload: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the rows travel in (uint8 for the coded payloads)."""
    if payload == "bf16":
        return torch.bfloat16
    return torch.uint8 if is_coded(payload) else dtype


def encode(x_ND: torch.Tensor, payload: str) -> torch.Tensor:
    """Rows -> what travels: [N, W] uint8 (codes then scale bytes) for the coded payloads, the rows
    in bf16 for `bf16`, the rows themselves for `native`. Not differentiable (see `round_rows`).

    The coded path is `ops.quant.quantize`'s rounding in four passes over the rows (amax, scale,
    clamp, cast) instead of its dozen: a non-finite block is found from its amax alone (amax
    propagates NaN and Inf) and marked by its scale only, as `quant.fake_quantize_fp32` does; its
    codes are whatever the cast gives, never read, since the NaN scale decodes the whole block to
    NaN. tests/ops/test_payload.py holds the decoded rows to `quant.fake_quantize` bit for bit."""
    if payload == "native":
        return x_ND
    if payload == "bf16":
        return x_ND.to(torch.bfloat16)
    _, block, _ = _CODES[payload]
    N, D = x_ND.shape
    if N == 0:
        return x_ND.new_zeros((0, row_bytes(payload, D, x_ND.dtype)), dtype=torch.uint8)
    pad = -D % block
    nb = (D + pad) // block
    x_blk = (F.pad(x_ND, (0, pad)) if pad else x_ND).reshape(N, nb, block)
    amax = x_blk.abs().amax(-1, keepdim=True).float()  # exact in any float dtype
    bad = ~torch.isfinite(amax)
    amax = torch.where(bad, 0.0, amax)
    if payload == "mxfp8":
        exp = e8m0_exponent_for(amax, EMAX_ELEM["e4m3"])
        scaled = x_blk * pow2(-exp)  # fp32 (type promotion), exact: a power of two
        scale_bytes = encode_e8m0(exp, bad).view(torch.uint8).reshape(N, nb)
    else:
        scale = torch.where(bad, float("nan"), amax / E4M3_MAX)
        scaled = x_blk / torch.where(scale > 0, scale, 1.0)  # = quantize's where(scale > 0, x / scale, x)
        scale_bytes = scale.reshape(N * nb).view(torch.uint8).reshape(N, nb * 4)
    codes = scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8).reshape(N, nb * block)
    return torch.cat([codes[:, :D], scale_bytes], 1)


def decode(w_NW: torch.Tensor, payload: str, D: int, dtype: torch.dtype) -> torch.Tensor:
    """What `encode` sent -> rows of width D in `dtype`. An all-zero wire row decodes to zeros (the
    zero row a receive buffer appends).

    mxfp8 into bf16 or fp32 multiplies in the target dtype: an E4M3 value times a power of two is
    exact in fp32, so rounding it to bf16 once (quant.dequantize's fp32 product, then the cast) and
    bf16's own correctly rounded product give the same bits. Other cases compute in fp32 and cast."""
    if payload == "native":
        return w_NW
    if payload == "bf16":
        return w_NW.to(dtype)
    _, block, _ = _CODES[payload]
    N = w_NW.shape[0]
    if N == 0:
        return w_NW.new_zeros((0, D), dtype=dtype)
    nb = -(-D // block)
    codes = w_NW[:, :D]
    if nb * block != D:
        codes = F.pad(codes, (0, nb * block - D))  # code 0 is +0
    vals = codes.contiguous().view(torch.float8_e4m3fn).reshape(N, nb, block)
    scale_bytes = w_NW[:, D:].contiguous()
    if payload == "mxfp8":
        scale = decode_e8m0(scale_bytes).reshape(N, nb, 1)
        work = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = vals.to(work) * scale.to(work)
    else:
        out = vals.float() * scale_bytes.view(torch.float32).reshape(N, nb, 1)
    return out.reshape(N, nb * block)[:, :D].to(dtype)


def fake(x_ND: torch.Tensor, payload: str) -> torch.Tensor:
    """decode(encode(x)) in x's dtype: the rows a destination receives (no autograd)."""
    return decode(encode(x_ND, payload), payload, x_ND.shape[1], x_ND.dtype)


class _RoundRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, payload: str) -> torch.Tensor:
        return fake(x_ND, payload)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        # straight-through, with the gradient rounded to bf16 as the EP wire sends it back
        return g.to(torch.bfloat16).to(g.dtype), None


def round_rows(x_ND: torch.Tensor, payload: str) -> torch.Tensor:
    """The rows as a destination receives them, differentiable (straight-through, the gradient
    rounded to bf16 as the EP backward sends it). Where no row crosses a wire (one process), the
    same numbers as under expert parallelism."""
    if payload == "native" or (payload == "bf16" and x_ND.dtype == torch.bfloat16):
        return x_ND
    return _RoundRows.apply(x_ND, payload)
