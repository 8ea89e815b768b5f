"""The capacity baseline (drops counted, equal to dropless when nothing drops) and config validation."""

from __future__ import annotations

import pytest
import torch

from dropless.config import MoEConfig, RouterConfig, apply_overrides
from dropless.layers.moe import MoELayer
from tolerances import CAPACITY_EQUIV, assert_close


def pair(**kw) -> tuple[MoELayer, MoELayer]:
    torch.manual_seed(0)
    dropless = MoELayer(16, MoEConfig(num_experts=6, top_k=2, d_expert=8, **kw))
    cap_kw = dict(kw)
    cap_kw.setdefault("capacity_factor", 100.0)
    capped = MoELayer(16, MoEConfig(num_experts=6, top_k=2, d_expert=8, **cap_kw))
    capped.load_state_dict(dropless.state_dict())
    return dropless, capped


@pytest.mark.parametrize("backend", ["padded_bmm", "grouped_mm", "loop"])
def test_large_capacity_equals_dropless(backend: str) -> None:
    # Nothing drops, so every kept row meets the same weights; but an expert's GEMM runs over C rows in
    # the capacity layout and over its count in the dropless one, and the BLAS rounds a row by the
    # rows around it on some kernel paths (MKL AVX2: not bit-exact even for the loop backend), so the
    # comparison is at that noise floor (tolerances.CAPACITY_EQUIV).
    dropless, capped = pair(backend="loop" if backend == "loop" else "grouped_mm")
    capped.experts.backend = backend
    x = torch.randn(30, 16)
    a, b = dropless(x), capped(x)
    assert int(b.stats.pairs_dropped) == 0
    assert_close(b.y, a.y, CAPACITY_EQUIV, msg=backend)


def test_small_capacity_drops_and_reports() -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=1, d_expert=8, capacity_factor=0.5,
                    router=RouterConfig(use_expert_bias=True))
    layer = MoELayer(16, cfg)
    layer.router.expert_bias.copy_(torch.tensor([100.0, 0, 0, 0]))  # all tokens pick expert 0
    out = layer(torch.randn(16, 16))
    C = 2  # ceil(0.5 * 16 / 4)
    assert int(out.stats.pairs_dropped) == 16 - C
    assert int(out.stats.pairs_computed) == C
    # dropped tokens get no routed output (no shared experts here)
    assert int((out.y.abs().sum(-1) > 0).sum()) == C


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_experts=4, top_k=5), "moe.top_k=5"),
    (dict(num_experts=8, router=RouterConfig(n_groups=4, topk_groups=5)), "moe.router.topk_groups=5"),
    (dict(num_experts=6, router=RouterConfig(n_groups=4)), "moe.router.n_groups=4"),
    (dict(router=RouterConfig(score_func="tanh")), "moe.router.score_func='tanh'"),
    (dict(activation="swish"), "moe.activation='swish'"),
    (dict(capacity_factor=-1.0), "moe.capacity_factor=-1.0"),
    (dict(top_k=1, router=RouterConfig(pre_softmax=False)), "moe.router.pre_softmax=False"),
    (dict(num_experts=0), "moe.num_experts=0"),
    (dict(backend="cuda_magic"), "moe.backend='cuda_magic'"),
    (dict(backend="padded_bmm"), "moe.backend='padded_bmm'"),
    (dict(num_experts=8, top_k=6, router=RouterConfig(n_groups=4, topk_groups=2)), "moe.router.topk_groups=2"),
])
def test_bad_config_names_field_and_value(kwargs, field) -> None:
    with pytest.raises(ValueError) as err:
        MoEConfig(**kwargs)
    assert field in str(err.value)


def test_dotted_overrides() -> None:
    cfg = apply_overrides(MoEConfig(), ["top_k=3", "router.score_func=sigmoid", "capacity_factor=1.25",
                                        "act_clamp=none", "router.use_expert_bias=true"])
    assert (cfg.top_k, cfg.router.score_func, cfg.capacity_factor) == (3, "sigmoid", 1.25)
    assert cfg.router.use_expert_bias is True and cfg.act_clamp is None
    with pytest.raises(ValueError, match="router.nope"):
        apply_overrides(MoEConfig(), ["router.nope=1"])
    with pytest.raises(ValueError, match="top_k='x'"):
        apply_overrides(MoEConfig(), ["top_k=x"])
    with pytest.raises(ValueError, match="top_k=99"):
        apply_overrides(MoEConfig(), ["top_k=99"])


@pytest.mark.parametrize("item", ["=3", "router.=1", ".top_k=2"])
def test_override_with_an_empty_name_says_so(item: str) -> None:
    with pytest.raises(ValueError, match="empty name"):
        apply_overrides(MoEConfig(), [item])
