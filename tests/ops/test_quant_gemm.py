"""Tests for dropless.ops.quant_gemm and its wiring into the MoE layer.

The three products (forward, dgrad, wgrad) are compared bit-exactly with a reference written here from
the formulas, quantising each expert segment on its own with `ops.quant.fake_quantize`; the layer is
compared with the full-precision layer under the loose floors of `tolerances.lowp_layer_rel_err`.
"""

from __future__ import annotations

import math

import pytest
import torch

from dropless.config import MoEConfig
from dropless.layers.experts import GroupedExperts
from dropless.layers.moe import MoELayer
from dropless.ops import quant_gemm as qg
from dropless.ops.permute import make_plan
from dropless.ops.quant import fake_quantize
from tolerances import assert_gemm_close, lowp_layer_rel_err

PRECISIONS = list(qg.RECIPES)

# Smallest widths that split into whole blocks: fp8 blockwise weights are 128x128 tiles.
WIDTHS = {"mxfp8": (64, 32), "fp8_blockwise": (128, 128), "nvfp4": (32, 16), "mxfp4": (64, 32)}


def _rows(counts: list[int], block: int, D: int, slack: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x_RD laid out as a plan would: each expert's rows padded with zero rows to a multiple of `block`,
    then `slack` unused rows (the plan's static bound) holding garbage that must not matter."""
    g = torch.Generator().manual_seed(seed)
    parts, ends, end = [], [], 0
    for c in counts:
        padded = -(-c // block) * block
        part = torch.zeros(padded, D)
        part[:c] = torch.randn(c, D, generator=g)
        parts.append(part)
        end += padded
        ends.append(end)
    parts.append(torch.randn(slack, D, generator=g) * 1e4)
    return torch.cat(parts), torch.tensor(ends, dtype=torch.int32)


def _reference(x_RD, w_EDF, dy_RF, offsets_E, precision, magnitudes: bool = False):
    """Hand-written from the docstring's table: per expert segment, fake-quantise, multiply in fp32.
    With `magnitudes`, also the same products of the operands' absolute values (|A| @ |B|), the scale
    of each element's rounding (tolerances.assert_gemm_close)."""
    r = qg.RECIPES[precision]
    ends = offsets_E.tolist()
    out = [torch.zeros(x_RD.shape[0], w_EDF.shape[2]), torch.zeros_like(x_RD), torch.zeros_like(w_EDF)]
    mag = [torch.zeros_like(t) for t in out]
    for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)):
        if t == s:
            continue
        products = [(fake_quantize(x_RD[s:t], r.act, -1), fake_quantize(w_EDF[e], r.weight, 0)),
                    (fake_quantize(dy_RF[s:t], r.grad, -1), fake_quantize(w_EDF[e], r.weight, 1).T),
                    (fake_quantize(x_RD[s:t], r.act, 0).T, fake_quantize(dy_RF[s:t], r.grad, 0))]
        for i, (a, b) in enumerate(products):
            where = (slice(s, t),) if i < 2 else (e,)
            out[i][where] = a @ b
            mag[i][where] = a.abs() @ b.abs()
    return (*out, *mag) if magnitudes else tuple(out)


# Why each layout exists: "mixed" has an empty expert (no rows, zero wgrad), groups that need padding
# rows, and one group of exactly one block; "one_expert" puts every row on the last expert (E-1 empty
# groups in front, so offsets repeat 0); E=3 is prime.
LAYOUTS = {"mixed": [5, 0, 1, 3], "one_expert": [0, 0, 7]}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_three_products_match_reference_exactly(precision: str, layout: str) -> None:
    D, Fo = WIDTHS[precision]
    block = qg.RECIPES[precision].token_block
    counts = [c * block // 4 + (block if c % 2 else 0) for c in LAYOUTS[layout]]  # partial blocks too
    x_RD, offsets_E = _rows(counts, block, D, slack=3, seed=0)
    E = len(counts)
    w_EDF = torch.randn(E, D, Fo, generator=torch.Generator().manual_seed(1)) * D ** -0.5
    dy_RF = torch.randn(x_RD.shape[0], Fo, generator=torch.Generator().manual_seed(2))

    x = x_RD.clone().requires_grad_(True)
    w = w_EDF.clone().requires_grad_(True)
    y = qg.quant_grouped_mm(x, w, offsets_E, precision)
    y.backward(dy_RF)

    y_ref, dx_ref, dw_ref, *mags = _reference(x_RD, w_EDF, dy_RF, offsets_E, precision, magnitudes=True)
    # The quantised operands are bit-exact (tests/ops/test_quant.py); the fp32 GEMMs on them run on
    # slices of a larger buffer here and on fresh tensors in the reference, which the BLAS may round
    # differently by CPU kernel path (seen under MKL_ENABLE_INSTRUCTIONS=AVX2): per-element bound.
    for name, got, ref, mag in zip(("y", "dx", "dw"), (y.detach(), x.grad, w.grad), (y_ref, dx_ref, dw_ref), mags):
        assert_gemm_close(got, ref, mag, msg=f"{precision} {layout} {name}")
    # The library's own reference is the same specification.
    for got, ref, mag in zip(qg.quant_grouped_mm_reference(x_RD, w_EDF, dy_RF, offsets_E, precision),
                             (y_ref, dx_ref, dw_ref), mags):
        assert_gemm_close(got, ref, mag, msg=f"{precision} {layout} library reference")
    # Quantisation did something: the product is not the fp32 one.
    assert not torch.equal(y_ref, qg._loop_mm(x_RD, w_EDF, offsets_E.tolist()))


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4"])
def test_bf16_inputs_keep_their_dtype(precision: str) -> None:
    D, Fo = WIDTHS[precision]
    block = qg.RECIPES[precision].token_block
    x_RD, offsets_E = _rows([block, 3], block, D, slack=0, seed=0)
    x = x_RD.bfloat16().requires_grad_(True)
    w = torch.randn(2, D, Fo).bfloat16().requires_grad_(True)
    y = qg.quant_grouped_mm(x, w, offsets_E, precision)
    y.float().sum().backward()
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    # bf16 -> fp32 is exact, so the bf16 run quantises the same numbers as an fp32 run of them.
    y32 = qg.quant_grouped_mm(x.detach().float(), w.detach().float(), offsets_E, precision)
    assert torch.equal(y, y32.bfloat16())


def test_unaligned_groups_are_refused() -> None:
    # align=1 plan: expert 0 ends at row 20, so rows 0..31 (one mxfp8 token block) hold both experts.
    ids_TK = torch.tensor([[0]] * 20 + [[1]] * 12)
    plan = make_plan(ids_TK, num_experts=2, align=1)
    assert plan.offsets_E.tolist() == [20, 32]
    x = torch.randn(plan.num_rows, 32)
    with pytest.raises(ValueError, match="straddle"):
        qg.quant_grouped_mm(x, torch.randn(2, 32, 32), plan.offsets_E, "mxfp8")


def test_aligned_plan_keeps_wgrad_blocks_inside_one_expert() -> None:
    # The plan built with plan_align pads expert 0 to 32 rows; then expert 0's weight gradient is
    # bit-identical however large expert 1's rows are. With a block straddling both experts, a 1e4
    # outlier from expert 1 would set the shared scale and flush expert 0's values to zero.
    ids_TK = torch.tensor([[0]] * 20 + [[1]] * 12)
    align = qg.plan_align("mxfp8", 1)
    plan = make_plan(ids_TK, num_experts=2, align=align)
    assert align == 32 and plan.offsets_E.tolist() == [32, 64]
    g = torch.Generator().manual_seed(0)
    x_TD, dy_RF = torch.randn(32, 32, generator=g), torch.randn(plan.num_rows, 32, generator=g)
    dws = []
    for scale in (1.0, 1e4):
        x_scaled = torch.cat([x_TD[:20], x_TD[20:] * scale, torch.zeros(1, 32)])  # last row: padding
        x_RD = x_scaled[plan.src_R]
        w = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        qg.quant_grouped_mm(x_RD, w, plan.offsets_E, "mxfp8").backward(dy_RF)
        dws.append(w.grad[0])
    assert torch.equal(dws[0], dws[1])


def test_plan_align() -> None:
    assert qg.plan_align("bf16", 8) == 8
    assert qg.plan_align("mxfp8", 1) == 32
    assert qg.plan_align("mxfp8", 48) == 96  # lcm, not max: every group end stays a multiple of both
    assert qg.plan_align("fp8_blockwise", 16) == 128
    assert qg.plan_align("nvfp4", 1) == 16
    assert qg.plan_align("mxfp4", 64) == 64


def test_value_errors() -> None:
    offsets = torch.tensor([32], dtype=torch.int32)
    with pytest.raises(ValueError, match="d=100"):
        qg.quant_grouped_mm(torch.randn(32, 100), torch.randn(1, 100, 32), offsets, "mxfp8")
    with pytest.raises(ValueError, match="f=64"):  # fp8 blockwise weights are 128x128 tiles
        qg.quant_grouped_mm(torch.randn(128, 128), torch.randn(1, 128, 64),
                            torch.tensor([128], dtype=torch.int32), "fp8_blockwise")
    with pytest.raises(ValueError, match="fp6"):
        qg.quant_grouped_mm(torch.randn(32, 32), torch.randn(1, 32, 32), offsets, "fp6")
    with pytest.raises(ValueError, match="d=100"):  # caught at build, not at the first step
        GroupedExperts(4, 100, 64, precision="mxfp4")
    with pytest.raises(ValueError, match="f=24"):
        MoELayer(32, MoEConfig(num_experts=4, top_k=2, d_expert=24, precision="nvfp4"))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_moe_layer_close_to_full_precision(precision: str) -> None:
    D, f = WIDTHS[precision] if precision == "fp8_blockwise" else (64, 32)
    block = qg.RECIPES[precision].token_block
    results = {}
    for prec in ("bf16", precision):
        torch.manual_seed(0)
        layer = MoELayer(D, MoEConfig(num_experts=4, top_k=2, d_expert=f, precision=prec))
        x = torch.randn(48, D, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        out = layer(x)
        g = torch.randn(out.y.shape, generator=torch.Generator().manual_seed(2))
        (out.y * g).sum().backward()
        res = {"y": out.y.detach(), "x": x.grad}
        res.update({n: p.grad for n, p in layer.named_parameters()})
        results[prec] = res
        if prec == precision:
            assert layer.dispatcher.align == math.lcm(1, block)
            assert layer.experts.precision == precision
    bound = lowp_layer_rel_err(precision)
    for name, ref in results["bf16"].items():
        got = results[precision][name]
        assert torch.isfinite(got).all(), name
        rel = float((got - ref).norm() / ref.norm())
        assert 0 < rel < bound, f"{precision} {name}: relative error {rel:.4f} vs bound {bound:.4f}"
