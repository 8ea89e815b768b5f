"""The model's design knobs (docs/model_knobs.md): MoE layer frequency, parallel block, and the
plain reference composition the block-level knobs are checked against.

Bit-exactness (torch.equal) is claimed where the reference runs the same modules on the same inputs
at the same shapes as the model does (docs/numerics.md: same computation, same bits), on the CPU in
fp32.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from dropless.config import ModelConfig, apply_overrides, load_config
from dropless.layers.moe import MoELayer
from dropless.model import MoEModel
from tiny_run import tiny

B, S = 2, 12


def model_cfg(*extra: str) -> ModelConfig:
    return tiny("model.n_layers=4", *extra).model


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(1))


def reference_forward(model: MoEModel, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, cross-entropy + MoE losses), composed by hand from the model's own modules: a block is
    x + attn(norm(x)), then + ffn(norm(.)) of the result, or of x itself for a parallel MoE block."""
    cos, sin = model.rope_cos[:S], model.rope_sin[:S]
    x = model.embed(tok)
    moe = []
    for block in model.blocks:
        if block.is_moe and model.cfg.block == "parallel_moe":
            # the MoE first, as the block issues it: the backward then accumulates x's gradient in
            # the same order (another order is another fp32 sum, not another function)
            out = block.ffn(block.ffn_norm(x))
            moe.append(out)
            x = x + block.attn(block.attn_norm(x), cos, sin) + out.y
            continue
        a = x + block.attn(block.attn_norm(x), cos, sin)
        if block.is_moe:
            out = block.ffn(block.ffn_norm(a))
            moe.append(out)
            x = a + out.y
        else:
            x = a + block.ffn(block.ffn_norm(a))
    logits = model.head(model.norm(x))
    ce = F.cross_entropy(logits.float().view(B * S, -1), tok.reshape(-1))
    return logits, ce + model.balancing_loss(moe)


def grads(model: MoEModel, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_against_reference(cfg: ModelConfig, recompute: list[str] | None = None) -> MoEModel:
    torch.manual_seed(0)
    model = MoEModel(replace(cfg, recompute=recompute or []))
    tok = tokens()
    out = model(tok, tok)
    got = grads(model, out.loss)
    ref_logits, ref_loss = reference_forward(model, tok)
    assert torch.equal(out.logits, ref_logits)
    assert torch.equal(out.loss, ref_loss)
    want = grads(model, ref_loss)
    assert got.keys() == want.keys()
    for n in got:
        assert torch.equal(got[n], want[n]), n
    return model


# ---- model.moe_layer_freq ----

@pytest.mark.parametrize("n_layers,dense,freq,want", [
    (4, 1, 1, (1, 2, 3)),          # today's layout: the prefix, then every layer
    (6, 1, 2, (1, 3, 5)),          # every 2nd layer counted from the first after the prefix
    (6, 0, 3, (0, 3)),
    (6, 2, 2, (2, 4)),
    (6, 1, [2, 5], (2, 5)),        # an explicit list
    (4, 4, 1, ()),                 # all dense
    (4, 0, [], ()),
])
def test_moe_layer_ids(n_layers: int, dense: int, freq, want: tuple[int, ...]) -> None:
    cfg = ModelConfig(n_layers=n_layers, n_dense_layers=dense, moe_layer_freq=freq)
    assert cfg.moe_layer_ids == want and cfg.n_moe_layers == len(want)
    model = MoEModel(cfg)
    assert tuple(i for i, b in enumerate(model.blocks) if b.is_moe) == want
    assert len(model.moe_layers()) == len(want)


@pytest.mark.parametrize("freq,why", [
    (0, "positive integer"), (-2, "positive integer"), ([0, 2], "first n_dense_layers"),
    ([3, 2], "strictly increasing"), ([1, 1], "strictly increasing"), ([1, 4], "n_layers=4"),
    ("2", "positive integer"), ([1.5], "integers"), (True, "positive integer"),
])
def test_moe_layer_freq_refused(freq, why: str) -> None:
    with pytest.raises(ValueError, match=r"model\.moe_layer_freq=.*" + why):
        ModelConfig(n_layers=4, n_dense_layers=1, moe_layer_freq=freq)


def test_moe_layer_freq_override_parses_int_and_list() -> None:
    cfg = load_config(None, ["model.n_layers=6", "model.moe_layer_freq=2"])
    assert cfg.model.moe_layer_ids == (1, 3, 5)
    cfg = apply_overrides(cfg, ["model.moe_layer_freq=[2, 4]"])
    assert cfg.model.moe_layer_freq == [2, 4] and cfg.model.moe_layer_ids == (2, 4)


@pytest.mark.parametrize("recompute", [[], ["layer"], ["moe"]], ids=lambda r: "+".join(r) or "none")
def test_moe_layer_freq_against_reference(recompute: list[str]) -> None:
    model = check_against_reference(model_cfg("model.moe_layer_freq=[1, 3]"), recompute)
    assert [b.is_moe for b in model.blocks] == [False, True, False, True]
    assert isinstance(model.blocks[3].ffn, MoELayer)


# ---- model.block = "parallel_moe" ----

@pytest.mark.parametrize("recompute", [[], ["layer"], ["moe"], ["attn", "norm"]],
                         ids=lambda r: "+".join(r) or "none")
def test_parallel_block_against_reference(recompute: list[str]) -> None:
    check_against_reference(model_cfg("model.block=parallel_moe"), recompute)


def test_parallel_block_moe_reads_the_block_input() -> None:
    # the MoE's input does not depend on attention: zeroing attention's output projection leaves
    # every MoE output unchanged, and the sequential block's MoE outputs do change
    for block, same in (("parallel_moe", True), ("sequential", False)):
        torch.manual_seed(0)
        model = MoEModel(model_cfg(f"model.block={block}"))
        tok = tokens()
        with torch.no_grad():
            before = [m.y for m in model(tok).moe]
            model.blocks[1].attn.out.weight.zero_()
            after = [m.y for m in model(tok).moe]
        assert torch.equal(before[0], after[0]) == same, block


def test_knobs_with_latent_attention() -> None:
    # DeepSeek-V3's attention (layers/mla.py) in every block, the MTP modules' included: the block
    # knobs compose with it; the hand-composed reference runs the same modules
    cfg = model_cfg("model.attention=mla", "model.kv_lora_rank=8", "model.head_dim=16",
                    "model.rope_head_dim=4", "model.block=parallel_moe", "model.moe_layer_freq=2",
                    "model.moe.n_identity_experts=1", "model.moe.latent_dim=16")
    check_against_reference(cfg, ["layer"])
    torch.manual_seed(0)
    model = MoEModel(replace(cfg, mtp_depth=1))
    out = model(tokens(), tokens())
    out.loss.backward()
    assert out.mtp_loss is not None and model.mtp[0].proj.weight.grad is not None
