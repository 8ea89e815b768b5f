"""The decode-time expert path (layers/decode_experts.py) against the grouped path of the same layer:
outputs, statistics and every gradient, on the shapes that break it; and when the layer takes it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dropless.config import MoEConfig, RouterConfig
from dropless.layers import decode_experts
from dropless.layers.moe import MoELayer
from dropless.layers.packed_experts import PackedExperts
from tolerances import assert_close

CASES = {
    # one token, k=2: the decode step of a batch of one
    "one_token": dict(T=1, d=16, E=8, K=2, f=12),
    # a small batch, several tokens sharing experts
    "batch": dict(T=6, d=16, E=8, K=2, f=12),
    # k=1: one pair per token, the sum over K is a copy
    "k1": dict(T=5, d=16, E=6, K=1, f=8),
    # k=E: every token meets every expert (each expert's rows are read T times)
    "k_eq_E": dict(T=4, d=16, E=4, K=4, f=8),
    # odd widths: the grouped path pads d and f to 16-byte strides, the decode path never does
    "odd_widths": dict(T=5, d=13, E=5, K=2, f=7),
    # every token on the same expert (forced by the bias below): one expert's rows read T
    # times, its gradient the sum over all of them
    "one_expert_for_all": dict(T=7, d=16, E=6, K=1, f=8, hot=3),
}


def build(T: int, d: int, E: int, K: int, f: int, hot: int | None = None, **kw) -> tuple[MoELayer, torch.Tensor]:
    router = kw.pop("router", RouterConfig(use_expert_bias=hot is not None))
    torch.manual_seed(0)
    layer = MoELayer(d, MoEConfig(num_experts=E, top_k=K, d_expert=f, router=router, **kw))
    if hot is not None:
        bias = torch.zeros(E)
        bias[hot] = 100.0  # selection only: the weights still come from the unbiased scores
        layer.router.expert_bias.copy_(bias)
    return layer, torch.randn(T, d, generator=torch.Generator().manual_seed(1))


def run(layer: MoELayer, x: torch.Tensor, max_tokens: int) -> tuple:
    layer.decode_max_tokens = max_tokens
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    g = torch.randn(out.y.shape, generator=torch.Generator().manual_seed(2))
    ((out.y * g).sum() + out.aux_loss + out.z_loss).backward()
    grads = {"x": x.grad, **{n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}}
    return out, grads


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_decode_path_matches_grouped(case: str, activation: str) -> None:
    layer, x = build(**CASES[case], activation=activation)
    big = x.shape[0]
    out_g, grads_g = run(layer, x, big)  # every call here takes the decode path
    out_r, grads_r = run(layer, x, 0)  # never: the grouped path
    if case == "one_expert_for_all":
        assert bool((out_r.ids_TK == 3).all())
    assert_close(out_g.y, out_r.y, msg="output")
    assert torch.equal(out_g.ids_TK, out_r.ids_TK)
    for field in ("tokens_per_expert_E", "pairs_computed"):
        assert torch.equal(getattr(out_g.stats, field), getattr(out_r.stats, field)), field
    assert out_g.stats.pairs_dropped is None and out_r.stats.pairs_dropped is None  # neither can drop
    assert grads_g.keys() == grads_r.keys()
    for name in grads_r:
        assert_close(grads_g[name], grads_r[name], msg=f"grad {name}")


def test_decode_path_is_taken_only_where_it_applies() -> None:
    taken = []
    real = decode_experts.row_sum_experts

    def spy(*a, **k):
        taken.append(True)
        return real(*a, **k)

    decode_experts.row_sum_experts = spy
    try:
        layer, x = build(T=3, d=16, E=4, K=2, f=8)
        layer.decode_max_tokens = 3
        layer(x)
        assert taken == [True]
        layer(torch.randn(4, 16))  # one token past the threshold
        assert taken == [True]
        layer.decode_max_tokens = None  # the device default, without autograd only
        cpu_max = decode_experts.DECODE_MAX_TOKENS["cpu"]
        layer(torch.randn(cpu_max, 16))  # autograd on: a training call stays on the grouped path
        assert taken == [True]
        with torch.no_grad():
            layer(torch.randn(cpu_max, 16))
            layer(torch.randn(cpu_max + 1, 16))
        with torch.inference_mode():
            layer(torch.randn(1, 16))
        assert taken == [True, True, True]
        layer.decode_max_tokens = 8
        layer.detailed_stats = True  # the health monitor reads expert-ordered rows: grouped path
        assert layer(x).stats.out_sq_E is not None and len(taken) == 3
        layer.detailed_stats = False
        for kw in (dict(capacity_factor=2.0), dict(precision="mxfp8"),
                   dict(router=RouterConfig(strategy="expert_choice", score_func="sigmoid")), "packed"):
            other, _ = build(T=3, d=32, E=4, K=2, f=32, **(kw if kw != "packed" else {}))
            if kw == "packed":  # 4-bit experts (serve/quantize): they dequantise what a step uses
                other.experts = PackedExperts.from_experts(other.experts, "mxfp4")
                other.eval()
            other.decode_max_tokens = 8
            with torch.no_grad():
                other(torch.randn(3, 32))
        assert len(taken) == 3
    finally:
        decode_experts.row_sum_experts = real


def test_autocast_keeps_the_grouped_path() -> None:
    # under autocast the grouped path casts every expert matrix to bf16; the decode path would have
    # to do the same to give the same numbers, so it steps aside
    taken = []
    real = decode_experts.row_sum_experts
    decode_experts.row_sum_experts = lambda *a, **k: taken.append(True) or real(*a, **k)
    try:
        layer, x = build(T=2, d=16, E=8, K=2, f=12)
        layer.decode_max_tokens = 8
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).y.dtype == torch.bfloat16
        assert taken == []
        layer(x)
        assert taken == [True]
    finally:
        decode_experts.row_sum_experts = real


def test_config_fields_untouched() -> None:
    # the threshold is a plain layer attribute (like detailed_stats), not config: a checkpoint's
    # config and the trainer's behaviour do not change with it
    assert "decode_max_tokens" not in {f.name for f in dataclasses.fields(MoEConfig)}
