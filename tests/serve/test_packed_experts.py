"""PackedExperts (layers/packed_experts.py): the 4-bit storage is ops.quant's encoding bit for bit, and
the forward equals GroupedExperts holding the dequantised weights.

Legend: E experts, D model width, F expert width, W gate|up width, R routed rows.
"""

from __future__ import annotations

import io

import pytest
import torch

from dropless.layers.experts import ExpertBatch, GroupedExperts
from dropless.layers.packed_experts import PackedExperts, check_packable, pack_weight, unpack_weight
from dropless.ops import quant_gemm
from dropless.ops._fp_formats import decode_e2m1, pack_fp4, unpack_fp4
from dropless.ops.quant import fake_quantize
from tolerances import REFERENCE, assert_close

FORMATS = ("mxfp4", "nvfp4")


def _awkward_weight(E: int, X: int, Y: int, seed: int = 0) -> torch.Tensor:
    """Random weights plus the blocks that break encoders: an all-zero block, a block at 2^-100, one
    at 2^60, exact E2M1 ties (0.25, 2.5 times a power of two) and a saturating element."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, X, Y, generator=g)
    w[0, :16, 0] = 0.0
    w[0, :16, 1] *= 2.0 ** -100
    w[1 % E, :16, 2] *= 2.0 ** 60
    w[-1, :8, 3] = torch.tensor([0.25, 0.75, 2.5, 5.0, -0.25, -1.75, 3.5, 6.0]) * 4
    return w


def _fq_per_expert(w_EXY: torch.Tensor, fmt: str) -> torch.Tensor:
    """The reference: ops.quant.fake_quantize of each expert's matrix along its reduction dim X."""
    return torch.stack([fake_quantize(w, fmt, dim=0) for w in w_EXY])


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantised_weights_are_the_fake_quantised_ones(fmt: str) -> None:
    # bit-exact against both the reference fake_quantize and what quant_gemm's forward multiplies
    for shape in ((4, 32, 64), (3, 64, 32)):  # gate|up (E, D, 2F) and down (E, F, D) shapes
        w = _awkward_weight(*shape)
        got = unpack_weight(*pack_weight(w, fmt), fmt)
        assert torch.equal(got, _fq_per_expert(w, fmt)), fmt
        assert torch.equal(got, quant_gemm._fq_weight(w, fmt, -2)), fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_e2m1_code_is_stored_and_read_bit_exactly(fmt: str) -> None:
    # one 32-row block along X per column holding the 16 E2M1 values twice, times 2^-5 (amax 6 * 2^-5,
    # so mxfp4's block scale is 2^-5): the stored nibbles must be the codes 0..15, element 2i in the
    # low nibble of byte i along X, and they must read back to ops.quant's values
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # (32,)
    w = (decode_e2m1(codes) * 2.0 ** -5).view(1, 32, 1).repeat(2, 1, 3)  # (E=2, X=32, Y=3)
    packed, scales, tensor_scale = pack_weight(w, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 16, 3)
    expect = (codes[0::2] | (codes[1::2] << 4)).view(1, 16, 1).expand(2, 16, 3)
    assert torch.equal(packed, expect)
    unpacked = unpack_fp4(packed.transpose(1, 2)).transpose(1, 2)  # (E, X, Y) codes
    assert torch.equal(unpacked, codes.view(1, 32, 1).expand(2, 32, 3))
    values = unpack_weight(packed, scales, tensor_scale, fmt)
    assert torch.equal(values, _fq_per_expert(w, fmt))
    if fmt == "mxfp4":  # a power-of-two scale: the values come back exactly
        assert torch.equal(scales, torch.full((2, 1, 3), 127 - 5, dtype=torch.uint8))
        assert torch.equal(values, w)
    else:  # E4M3 block scale 448 times the fp32 tensor scale amax / 2688: within an ulp of 2^-5
        assert_close(values, w, REFERENCE[torch.float32])


def test_pack_unpack_every_byte_and_odd_counts() -> None:
    # all 256 (low, high) code pairs survive pack -> unpack; an odd count of codes is refused
    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    codes = torch.stack([lo.flatten(), hi.flatten()], dim=-1).flatten().to(torch.uint8)  # (512,)
    packed = pack_fp4(codes)
    assert torch.equal(packed, torch.arange(256, dtype=torch.uint8).view(16, 16).T.flatten())
    assert torch.equal(unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="even last dim"):
        pack_fp4(codes[:3])
    # widths the block does not divide (odd ones included) are refused before anything is packed
    for fmt, d_expert in (("mxfp4", 48), ("nvfp4", 24), ("nvfp4", 33)):
        with pytest.raises(ValueError, match=f"model.moe.d_expert={d_expert}"):
            check_packable(fmt, 32, d_expert)
    with pytest.raises(ValueError, match="experts='int4'"):
        check_packable("int4", 32, 32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_round_trip_through_save_and_dtype_casts(fmt: str) -> None:
    # the buffers are integer bits: torch.save/load and model.to(bf16) must leave them unchanged
    # (an fp32 tensor-scale buffer would be rounded by .to(bf16))
    g = GroupedExperts(3, 32, 32, backend="loop")
    p = PackedExperts.from_experts(g, fmt)
    before = {k: v.clone() for k, v in p.state_dict().items()}
    buf = io.BytesIO()
    torch.save(p.state_dict(), buf)
    buf.seek(0)
    q = PackedExperts(3, 32, 32, fmt, backend="loop")
    q.load_state_dict(torch.load(buf, weights_only=True))
    q.to(torch.bfloat16)
    for k, v in q.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
    if fmt == "nvfp4":  # the int32 bits are the fp32 tensor scale of each expert, amax / (448 * 6)
        amax_E = g.w_down_EFD.detach().abs().amax(dim=(1, 2))
        assert torch.equal(q.down_tensor_scale.view(torch.float32), amax_E / (448 * 6))


def _batch(counts: list[int], D: int, seed: int, weighted: bool = True, pad: int = 0) -> ExpertBatch:
    g = torch.Generator().manual_seed(seed)
    R = sum(counts)
    offsets_E = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(R + pad, D, generator=g)
    w = torch.rand(R + pad, generator=g) if weighted else None
    return ExpertBatch(x, offsets_E, None, w)


def _pair(fmt: str, E: int, D: int, F: int, kind: str, backend: str, seed: int = 0
          ) -> tuple[PackedExperts, GroupedExperts]:
    torch.manual_seed(seed)
    src = GroupedExperts(E, D, F, kind, backend=backend)
    packed = PackedExperts.from_experts(src, fmt).eval()
    ref = GroupedExperts(E, D, F, kind, backend=backend)
    with torch.no_grad():
        ref.w_gate_up_EDF.copy_(_fq_per_expert(src.w_gate_up_EDF.detach(), fmt))
        ref.w_down_EFD.copy_(_fq_per_expert(src.w_down_EFD.detach(), fmt))
    return packed, ref


# Why each case: an empty expert in the middle and at both ends (the cut offsets must still tile the
# rows); every row on one expert (A = 1); prime E; a single row (decode, T*K = 1); rows past the last
# group (a plan's static slack, never read); unweighted rows; a non-gated activation.
CASES = [
    ("empty_middle_and_ends", [0, 5, 0, 7, 0], "swiglu", 0, True),
    ("all_on_one", [0, 0, 9, 0], "swiglu", 0, True),
    ("prime_E", [3, 1, 4, 1, 5, 0, 2], "swiglu", 0, True),
    ("one_row", [0, 1, 0, 0], "swiglu", 0, True),
    ("slack_rows", [2, 0, 3], "swiglu", 4, True),
    ("unweighted", [4, 4, 0, 1], "swiglu", 0, False),
    ("relu2", [2, 0, 6, 1], "relu2", 0, True),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
@pytest.mark.parametrize("name,counts,kind,pad,weighted", CASES, ids=[c[0] for c in CASES])
def test_forward_equals_grouped_experts_on_dequantised_weights(fmt, backend, name, counts, kind, pad,
                                                               weighted) -> None:
    E, D, F = len(counts), 32, 32
    packed, ref = _pair(fmt, E, D, F, kind, backend)
    batch = _batch(counts, D, seed=len(name), weighted=weighted, pad=pad)
    end = sum(counts)
    with torch.no_grad():
        y, y_ref = packed(batch), ref(batch)
        assert_close(y[:end], y_ref[:end], REFERENCE[torch.float32], name)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the weights cast to bf16, as GroupedExperts
            yb, yb_ref = packed(batch), ref(batch)
    assert yb.dtype == yb_ref.dtype == torch.bfloat16
    assert_close(yb[:end], yb_ref[:end], REFERENCE[torch.bfloat16], name)


def test_only_the_experts_with_rows_are_dequantised(monkeypatch: pytest.MonkeyPatch) -> None:
    packed, _ = _pair("mxfp4", 6, 32, 32, "swiglu", "grouped_mm")
    seen: list[list[int]] = []
    real = PackedExperts.dequantized

    def spy(self, ids_A):
        seen.append(ids_A.tolist())
        return real(self, ids_A)

    monkeypatch.setattr(PackedExperts, "dequantized", spy)
    with torch.no_grad():
        packed(_batch([0, 3, 0, 0, 2, 0], 32, seed=1))
        y = packed(_batch([0] * 6, 32, seed=1, pad=3))
    assert seen == [[1, 4]]  # the empty batch dequantises nothing
    assert y.shape == (3, 32)


def test_capacity_layout_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    # padded_bmm: every expert holds C slots (padding rows weight 0), so all E are dequantised
    packed, ref = _pair("nvfp4", 4, 32, 32, "swiglu", "padded_bmm")
    C = 3
    g = torch.Generator().manual_seed(2)
    batch = ExpertBatch(torch.randn(4 * C, 32, generator=g),
                        torch.arange(1, 5, dtype=torch.int32) * C, C, torch.rand(4 * C, generator=g))
    with torch.no_grad():
        assert_close(packed(batch), ref(batch), REFERENCE[torch.float32], "capacity")


def test_training_a_packed_model_is_refused() -> None:
    packed, _ = _pair("mxfp4", 2, 32, 32, "swiglu", "loop")
    packed.train()
    with pytest.raises(RuntimeError, match="inference-only"):
        packed(_batch([1, 1], 32, seed=0))
    assert not list(packed.parameters())  # nothing an optimizer could update
