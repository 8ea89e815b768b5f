"""The CPU bf16 row bucket (ops/grouped_gemm.py `row_bucket`): the local dispatcher rounds each expert
group up to 32 rows for bf16 GEMMs on the CPU, so oneDNN meets few distinct shapes. The padding rows
are zero rows whose outputs combine never reads: the layer computes the same function."""

from __future__ import annotations

import pytest
import torch

from dropless.layers.moe import MoELayer
from dropless.moe_config import MoEConfig
from dropless.ops import grouped_gemm
from tolerances import REFERENCE, assert_close

# T*K/E = 1024 rows per group on average: above the 8-bucket floor where the bucket applies
T, D, E, K, F = 2048, 32, 4, 2, 16


def layer_and_input(seed: int = 0) -> tuple[MoELayer, torch.Tensor]:
    torch.manual_seed(seed)
    layer = MoELayer(D, MoEConfig(num_experts=E, top_k=K, d_expert=F))
    return layer, torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 1))


def offsets(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    decision = layer.router(x)
    batch, _ = layer.dispatcher.dispatch(x, decision)
    return batch.offsets_E


def run(layer: MoELayer, x: torch.Tensor, autocast: bool) -> list[torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = layer(x)
    g = torch.randn(out.y.shape, generator=torch.Generator().manual_seed(7))
    (out.y.float() * g).sum().backward()
    return [out.y.detach().float(), x.grad, *(p.grad for p in layer.parameters())]


def test_bucket_rule() -> None:
    x = torch.zeros(4, 8)
    assert grouped_gemm.row_bucket(x, 256) == 1  # fp32: MKL, no per-shape kernel
    assert grouped_gemm.row_bucket(x.bfloat16(), 256) == 32
    assert grouped_gemm.row_bucket(x.bfloat16(), 255) == 1  # small groups: padding would cost > ~6%
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_gemm.row_bucket(x, 1024) == 32  # fp32 rows, bf16 GEMMs
    assert grouped_gemm.row_bucket(torch.zeros(4, 8, dtype=torch.bfloat16, device="meta"), 1024) == 1


def test_bf16_autocast_groups_are_whole_buckets() -> None:
    layer, x = layer_and_input()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ends = offsets(layer, x)
    assert bool((ends % grouped_gemm.CPU_LOWP_ROW_BUCKET == 0).all()), ends
    plain = offsets(layer, x)  # fp32: the unpadded plan, ends at the cumulative counts
    counts = torch.bincount(layer.router(x).ids_TK.reshape(-1), minlength=E)
    assert torch.equal(plain.long(), counts.cumsum(0))
    assert bool((ends.long() >= plain.long()).all())


def test_padded_plan_computes_the_same_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bucketed bf16 layer against the same layer with the bucket off: output and every gradient
    at the bf16 tolerance (the same rows, the same bf16 operands; only the GEMMs' row counts differ,
    which may round a row's fp32 accumulation differently before its bf16 rounding)."""
    layer, x = layer_and_input(3)
    padded = run(layer, x, autocast=True)
    monkeypatch.setattr(grouped_gemm, "CPU_LOWP_ROW_BUCKET", 1)
    plain = run(layer, x, autocast=True)
    names = ["y", "dx", *(n for n, _ in layer.named_parameters())]
    for a, b, name in zip(padded, plain, names):
        # the weight gradients sum T*K/E rows: their rounding follows the sum of |terms|
        terms = b.abs().max() * torch.ones_like(b) if name.startswith("experts") else None
        assert_close(a.float(), b.float(), REFERENCE[torch.bfloat16], name, terms=terms)
