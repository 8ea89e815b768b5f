"""The dispatch payload's encodings (ops/payload.py): what a destination decodes is exactly the
quantiser's own rounding, MX rounding is idempotent (so mxfp8 experts requantise a received row to
the same codes), the wire is as wide as the table says, and the rounding's gradient is the identity (rounded to bf16, as the EP backward's wire)."""

from __future__ import annotations

import pytest
import torch

from dropless.ops import payload
from dropless.ops.quant import fake_quantize, fake_quantize_fp32

CODED = {"mxfp8": "mxfp8_e4m3", "fp8_blockwise": "fp8_blockwise_act"}


def _rows(N: int, D: int, seed: int = 0) -> torch.Tensor:
    """Rows over 12 decades, with the edges: zeros, a saturating block (amax with a large mantissa),
    values near the E4M3 subnormals, ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen) * torch.logspace(-6, 6, N)[:, None]
    x[0] = 0.0
    x[1, :] = 1.0
    x[1, 0] = 511.0 / 256  # top binade's largest mantissa: saturates to 448 x scale
    x[2, :] = 2.0**-9 * torch.arange(D) / 4  # E4M3 subnormal steps and ties between them
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pl", ["mxfp8", "fp8_blockwise"])
def test_decode_is_the_quantisers_rounding(pl: str, dtype: torch.dtype) -> None:
    x = _rows(9, 256).to(dtype)
    wire = payload.encode(x, pl)
    assert wire.dtype == torch.uint8 and wire.shape == (9, payload.row_bytes(pl, 256, dtype))
    got = payload.decode(wire, pl, 256, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, fake_quantize(x, CODED[pl], -1))


@pytest.mark.parametrize("D", [40, 130, 31])
@pytest.mark.parametrize("pl", ["mxfp8", "fp8_blockwise"])
def test_odd_width_has_a_short_last_block(pl: str, D: int) -> None:
    """A width that is not a multiple of the block: the row zero-padded to the block, the padding
    never sent, the decoded row the padded row's rounding cut back."""
    x = _rows(7, D, seed=3)
    block = {"mxfp8": 32, "fp8_blockwise": 128}[pl]
    Dp = -(-D // block) * block
    padded = torch.nn.functional.pad(x, (0, Dp - D))
    assert torch.equal(payload.fake(x, pl), fake_quantize(padded, CODED[pl], -1)[:, :D])
    assert payload.row_bytes(pl, D, torch.float32) == D + Dp // block * (1 if pl == "mxfp8" else 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_rounding_is_idempotent(dtype: torch.dtype) -> None:
    """Quantising a decoded mxfp8 row again gives it back bit for bit, so the experts' own mxfp8
    quantisation of a received row changes nothing (the parity with local rounding rests on it)."""
    for seed in range(4):
        y = payload.fake(_rows(16, 64, seed).to(dtype), "mxfp8")
        assert torch.equal(fake_quantize_fp32(y.float(), "mxfp8_e4m3", -1).to(dtype), y), seed


def test_non_finite_blocks_arrive_as_nan_and_zero_rows_as_zeros() -> None:
    x = torch.randn(3, 64)
    x[0, 5], x[1, 40] = float("nan"), float("inf")
    for pl in CODED:
        y = payload.fake(x, pl)
        block = {"mxfp8": 32, "fp8_blockwise": 64}[pl]  # fp8 blockwise: one short block of 64
        assert y[0, :block].isnan().all() and y[1, 64 - block:].isnan().all(), pl
        assert torch.isfinite(y[2]).all(), pl
        zeros = torch.zeros(2, payload.row_bytes(pl, 64, torch.float32), dtype=torch.uint8)
        assert torch.equal(payload.decode(zeros, pl, 64, torch.float32), torch.zeros(2, 64)), pl
    assert payload.encode(torch.zeros(0, 64), "mxfp8").shape == (0, 66)
    assert payload.decode(torch.zeros(0, 68, dtype=torch.uint8), "fp8_blockwise", 64, torch.bfloat16).shape == (0, 64)


def test_wire_widths() -> None:
    """Bytes per row at D = 1024: mxfp8 is 0.516 of bf16 (codes + one scale byte per 32)."""
    rb = {pl: payload.row_bytes(pl, 1024, torch.bfloat16) for pl in payload.PAYLOADS}
    assert rb == {"native": 2048, "bf16": 2048, "mxfp8": 1056, "fp8_blockwise": 1056}
    assert payload.row_bytes("native", 1024, torch.float32) == 4096
    assert payload.row_bytes("bf16", 1024, torch.float32) == 2048
    assert payload.wire_dtype("bf16", torch.float32) == torch.bfloat16


def test_round_rows_is_straight_through() -> None:
    x = _rows(5, 64).requires_grad_(True)
    g = torch.randn(5, 64)
    for pl in ("mxfp8", "fp8_blockwise", "bf16"):
        x.grad = None
        y = payload.round_rows(x, pl)
        assert torch.equal(y.detach(), payload.fake(x.detach(), pl))
        y.backward(g)
        assert torch.equal(x.grad, g.bfloat16().float()), pl  # as the EP wire sends it back
    xb = x.detach().bfloat16()
    assert payload.round_rows(xb, "bf16") is xb and payload.round_rows(x, "native") is x


def test_unknown_payload_refused() -> None:
    with pytest.raises(ValueError, match="dispatch_dtype='e5m2'"):
        payload.check("e5m2")
