"""train.lora on the model: where adapters go, what stays frozen, the start that is the base model
bit for bit, merge-lora, and the refusals (lora_config.py, layers/lora.py, model_lora.py)."""

from __future__ import annotations

import pytest
import torch

from dropless.config import LoRAConfig, load_config
from dropless.hf.merge_lora import merged_state
from dropless.layers.lora import LoRALinear, has_expert_adapters
from dropless.model import MoEModel
from dropless.train.optim import build_optimizer
from tests.tolerances import REFERENCE, assert_close

MLA = ["model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.rope_head_dim=8",
       "model.v_head_dim=16", "model.n_dense_layers=1", "model.moe.n_shared_experts=1"]
EVERY_TARGET = 'train.lora.targets=["attn","mla_low_rank","shared","dense","experts","router"]'


def models(*sets: str) -> tuple[MoEModel, MoEModel, object]:
    cfg = load_config(None, ["model.d_model=64", "model.n_layers=3", "model.n_heads=4", *sets])
    base = MoEModel(cfg.model, seed=5)
    return base, MoEModel(cfg.model, seed=5, lora=cfg.train.lora), cfg


@pytest.mark.parametrize("sets", [["train.lora.rank=4"], ["train.lora.rank=3", EVERY_TARGET, *MLA],
                                  ["train.lora.rank=2", "model.n_heads=4", "model.n_kv_heads=2", "model.attn_bias=true",
                                   "model.qk_norm=true"]], ids=["attn+experts", "mla-every-target", "gqa-bias"])
def test_zero_b_start_is_the_base_model_bit_for_bit(sets: list[str]) -> None:
    base, adapted, _ = models(*sets)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(base(tokens).logits, adapted(tokens).logits)
    # the base's names and values are the adapted model's: a base checkpoint loads unchanged
    sd = adapted.state_dict()
    for name, t in base.state_dict().items():
        assert torch.equal(sd[name], t), name


def test_targets_and_layers_place_adapters_and_freeze_the_rest() -> None:
    _, m, _ = models("train.lora.rank=3", EVERY_TARGET, "train.lora.layers=[0,2]", *MLA)
    adapted = {n for n, mod in m.named_modules() if isinstance(mod, LoRALinear)}
    assert adapted == {"blocks.0.attn.q_a", "blocks.0.attn.q_b", "blocks.0.attn.kv_a", "blocks.0.attn.kv_b",
                       "blocks.0.attn.out", "blocks.0.ffn.gate_up", "blocks.0.ffn.down",
                       "blocks.2.attn.q_a", "blocks.2.attn.q_b", "blocks.2.attn.kv_a", "blocks.2.attn.kv_b",
                       "blocks.2.attn.out", "blocks.2.ffn.shared.gate_up", "blocks.2.ffn.shared.down"}
    assert has_expert_adapters(m.blocks[2].ffn.experts) and not has_expert_adapters(m.blocks[1].ffn.experts)
    trains = {n for n, p in m.named_parameters() if p.requires_grad}
    assert "blocks.2.ffn.router.weight" in trains and "blocks.1.ffn.router.weight" not in trains
    assert all(".lora_" in n or n.endswith("router.weight") for n in trains), trains
    assert not any(p.requires_grad for n, p in m.named_parameters() if n.startswith(("embed", "head", "norm")))


def test_only_adapters_get_gradients_and_optimizer_state() -> None:
    _, m, cfg = models("train.lora.rank=4")
    opt = build_optimizer(m, cfg.train)
    tokens = torch.randint(0, 256, (2, 24))
    m(tokens, tokens).loss.backward()
    opt.step()
    for n, p in m.named_parameters():
        assert (p.grad is not None) == p.requires_grad, n
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in m.parameters() if p.requires_grad}
    assert len(opt.state) == len(in_opt)


def test_merged_model_computes_the_adapted_model() -> None:
    _, m, cfg = models("train.lora.rank=4", 'train.lora.targets=["attn","experts","dense"]', "model.n_dense_layers=1")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.requires_grad:  # B nonzero: the adapters change the model
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    plain = MoEModel(cfg.model, seed=0)
    plain.load_state_dict(merged_state(m))
    tokens = torch.randint(0, 256, (2, 24), generator=g)
    with torch.no_grad():
        a, b = m(tokens).logits, plain(tokens).logits
    assert not torch.equal(a, MoEModel(cfg.model, seed=5)(tokens).logits)
    assert_close(b, a, REFERENCE[torch.float32])


@pytest.mark.parametrize("sets, field", [
    (["train.lora.rank=-1"], "train.lora.rank"),
    (["train.lora.rank=4", "train.lora.alpha=0"], "train.lora.alpha"),
    (["train.lora.rank=4", 'train.lora.targets=["mlp"]'], "train.lora.targets"),
    (["train.lora.rank=4", 'train.lora.targets=["shared"]'], "train.lora.targets"),
    (["train.lora.rank=4", 'train.lora.targets=["mla_low_rank"]'], "train.lora.targets"),
    (["train.lora.rank=4", "train.lora.layers=[9]"], "train.lora.layers"),
    (["train.lora.rank=4", "train.lora.dropout=0.1"], "train.lora.dropout"),
    (["train.lora.rank=4", "model.moe.precision=mxfp8"], "train.lora.rank"),
    (["train.lora.rank=4", "train.lora.base=nvfp4", "model.moe.d_expert=40"], "train.lora.base"),
    (["train.lora.base=bf16"], "train.lora.base"),
    (["train.lora.rank=4", "train.lora.base_from=/some/dir"], "train.lora.base_from"),
])
def test_refusals_name_the_field(sets: list[str], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_config(None, sets)


def test_dropout_on_dense_targets_is_taken() -> None:
    cfg = load_config(None, ["train.lora.rank=4", "train.lora.dropout=0.1", 'train.lora.targets=["attn"]'])
    assert cfg.train.lora == LoRAConfig(rank=4, dropout=0.1, targets=["attn"])
