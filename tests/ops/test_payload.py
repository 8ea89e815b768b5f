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


# -- mxfp8 experts take the decoded rows as they are ------------------------------------------------

def _gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, rows_format: str | None):
    from dropless.ops.quant_gemm import quant_grouped_mm

    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = quant_grouped_mm(x, w, offsets, "mxfp8", rows_format)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)))
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_gemm_skips_its_forward_quantisation_of_exact_rows(dtype: torch.dtype,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows an mxfp8 payload decoded (`exact_format`) into an mxfp8 GEMM: the forward takes them as they
    are, one quantisation pass fewer, and y, dx and dw are the same bits. The rows of a native payload
    are not exact: the same promise about them changes y (what would catch a wrong promise)."""
    from dropless.ops import quant_gemm

    gen = torch.Generator().manual_seed(3)
    x = _rows(96, 64).to(dtype)[torch.randperm(96, generator=gen)] * 1e-3
    w = torch.randn(3, 64, 32, generator=gen).to(dtype)
    offsets = torch.tensor([32, 32, 96], dtype=torch.int32)  # an empty expert in the middle
    fmt = payload.exact_format("mxfp8")
    assert fmt == "mxfp8_e4m3" and payload.exact_format("fp8_blockwise") is None
    assert payload.exact_format("native") is None and payload.exact_format("bf16") is None
    xr = payload.round_rows(x, "mxfp8").detach()
    calls = []
    real = quant_gemm._fq_rows
    monkeypatch.setattr(quant_gemm, "_fq_rows", lambda *a: calls.append(a[2:4]) or real(*a))
    ref = _gemm(xr, w, offsets, None)
    n_ref = len(calls)
    got = _gemm(xr, w, offsets, fmt)
    assert len(calls) - n_ref == n_ref - 1 and ("mxfp8_e4m3", -1) not in calls[n_ref:]
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert not torch.equal(_gemm(x, w, offsets, fmt)[0], _gemm(x, w, offsets, None)[0])


def test_moe_layer_with_mxfp8_payload_and_experts_hands_the_promise_on() -> None:
    """The layer tags the batch with its dispatcher's `rows_format`; with the skip, the mxfp8 layer over
    mxfp8-rounded rows gives the bits of the same layer told nothing."""
    import copy

    from dropless.config import MoEConfig
    from dropless.layers.dispatch import LocalDispatcher
    from dropless.layers.moe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(64, MoEConfig(num_experts=4, top_k=2, d_expert=32, precision="mxfp8"))
    layer.dispatcher = LocalDispatcher(4, align=layer.dispatcher.align, payload="mxfp8")
    assert layer.dispatcher.rows_format == "mxfp8_e4m3"
    plain = copy.deepcopy(layer)
    seen = []
    real = layer.experts.forward
    layer.experts.forward = lambda b: seen.append(b.rows_format) or real(b)  # type: ignore[method-assign]

    class Silent(LocalDispatcher):
        rows_format = None  # type: ignore[assignment]

    plain.dispatcher = Silent(4, align=layer.dispatcher.align, payload="mxfp8")
    x = torch.randn(40, 64)
    outs = []
    for m in (layer, plain):
        xi = x.clone().requires_grad_(True)
        y = m(xi).y
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, [p.grad for p in m.parameters()]))
    assert seen == ["mxfp8_e4m3"]
    (ya, ga, pa), (yb, gb, pb) = outs
    assert torch.equal(ya, yb) and torch.equal(ga, gb)
    assert all(torch.equal(a, b) for a, b in zip(pa, pb) if a is not None)
