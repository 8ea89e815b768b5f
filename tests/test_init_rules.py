"""Initial weights from (seed, parameter name), row by row (layers/init.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dropless.config import apply_overrides, load_config
from dropless.layers import init
from dropless.model import MoEModel
from dropless.runs import presets

KNOBS = [[], ["model.attention=mla", "model.q_lora_rank=32", "model.kv_lora_rank=16", "model.rope_head_dim=8"],
         ["model.moe.latent_dim=32"], ["model.mtp_depth=1", "model.mtp_block=moe"],
         ["model.attn_bias=true", "model.moe.n_shared_experts=1", "model.tie_embeddings=true"]]


def _cfg(extra: list[str]):
    return apply_overrides(load_config(presets.preset_path("tiny")),
                           ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", *extra]).model


@pytest.mark.parametrize("extra", KNOBS, ids=lambda e: ",".join(e) or "default")
def test_every_parameter_has_a_rule_and_the_seed_decides(extra: list[str]) -> None:
    cfg = _cfg(extra)
    a, b, c = MoEModel(cfg, seed=7), MoEModel(cfg, seed=7), MoEModel(cfg, seed=8)
    rules = init.collect_rules(a)
    assert set(rules) == {n for n, _ in a.named_parameters()}
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if rules[n].kind != "const":
            assert not torch.equal(p, r), n


def test_rules_say_the_distribution() -> None:
    cfg = _cfg(["model.d_model=256", "model.n_heads=4"])
    model = MoEModel(cfg, seed=1)
    rules = init.collect_rules(model)
    out = rules["blocks.0.attn.out.weight"]
    assert out == init.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)  # the model's override
    assert rules["blocks.0.attn.qkv.weight"] == init.uniform(256 ** -0.5)  # nn.Linear's default
    assert rules["blocks.0.attn_norm.weight"] == init.const(1.0)
    w = model.blocks[1].ffn.experts.w_gate_up_EDF
    assert rules["blocks.1.ffn.experts.w_gate_up_EDF"] == init.normal(w.shape[1] ** -0.5)
    assert abs(w.std().item() / w.shape[1] ** -0.5 - 1) < 0.02
    q = model.blocks[0].attn.qkv.weight
    assert q.abs().max().item() <= 256 ** -0.5 and abs(q.std().item() * 3 ** 0.5 / 256 ** -0.5 - 1) < 0.02
    assert torch.equal(model.blocks[0].attn_norm.weight, torch.ones(256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_range_is_the_whole_parameters_rows(dtype: torch.dtype) -> None:
    rule = init.normal(0.5)
    whole = torch.empty(11, 3, 5)
    init.fill_(init.LocalRows(whole, 0, 11), rule, seed=3, name="w")
    part = torch.empty(4, 3, 5, dtype=dtype)
    init.fill_(init.LocalRows(part, 6, 11), rule, seed=3, name="w")  # rows 6..9, through the staging copy
    assert torch.equal(part, whole[6:10].to(dtype))
    vec = torch.empty(9)
    init.fill_(init.LocalRows(vec, 0, 9), init.uniform(1.0), seed=3, name="b")
    tail = torch.empty(3)
    init.fill_(init.LocalRows(tail, 6, 9), init.uniform(1.0), seed=3, name="b")
    assert torch.equal(tail, vec[6:])
    other = torch.empty(11, 3, 5)
    init.fill_(init.LocalRows(other, 0, 11), rule, seed=3, name="v")  # another name, other values
    assert not torch.equal(other, whole)


def test_a_parameter_without_a_rule_is_refused() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    with pytest.raises(ValueError, match="'scale' has no initialisation rule"):
        init.collect_rules(Odd())
