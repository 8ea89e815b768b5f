"""LatentMoE, `moe.latent_dim` (layers/latent.py): l = d with identity projections is the plain layer
bit for bit (the same expert GEMMs on the same rows; a product with an identity matrix is exact in
fp32: each output sums one exact product with zeros), and l < d (with and without the latent norm,
with identity and shared experts) matches the per-token loop reference in output and every gradient."""

from __future__ import annotations

import pytest
import torch

from dropless.config import ModelConfig, MoEConfig
from dropless.layers.moe import MoELayer
from test_moe_layer import build, check_against_reference, grads
from test_model_knobs import check_against_reference as check_model, model_cfg

D = 16


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "keep"])
@pytest.mark.parametrize("extra", [dict(), dict(n_shared_experts=1), dict(n_identity_experts=2)],
                         ids=["plain", "shared", "identity"])
def test_latent_equal_to_d_with_identity_projections_is_the_plain_layer(lean: bool, extra: dict) -> None:
    plain = build(D, E=6, K=2, f=12, **extra)
    latent = build(D, E=6, K=2, f=12, latent_dim=D, **extra)
    missing = latent.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["latent.down.weight", "latent.up.weight"]
    with torch.no_grad():
        latent.latent.down.weight.copy_(torch.eye(D))
        latent.latent.up.weight.copy_(torch.eye(D))
    plain.experts.lean = latent.experts.lean = lean
    x = torch.randn(3, 7, D)
    y_p, g_p = grads(plain, x, lambda x: plain(x).y)
    y_l, g_l = grads(latent, x, lambda x: latent(x).y)
    assert torch.equal(y_p, y_l)
    for name in g_p:
        assert torch.equal(g_p[name], g_l[name]), name
    assert set(g_l) - set(g_p) == {"latent.down.weight", "latent.up.weight"}


@pytest.mark.parametrize("case", [
    dict(latent_dim=8), dict(latent_dim=8, latent_norm=True), dict(latent_dim=5, K=1),
    dict(latent_dim=8, n_identity_experts=2, n_shared_experts=1),
], ids=["l8", "l8_norm", "l5_k1", "l8_identity_shared"])
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "keep"])
def test_latent_layer_against_reference(case: dict, lean: bool) -> None:
    case = dict(case)
    layer = build(D, E=6, K=case.pop("K", 2), f=12, **case)
    layer.experts.lean = lean
    assert layer.experts.w_gate_up_EDF.shape[1] == case["latent_dim"]
    check_against_reference(layer, torch.randn(2, 9, D))


def test_latent_decode_path_matches_grouped() -> None:
    # the decode-size expert path reads the latent rows too (generation's path)
    layer = build(D, E=6, K=2, f=12, latent_dim=8, latent_norm=True)
    x = torch.randn(4, D)
    with torch.no_grad():
        layer.decode_max_tokens = 0
        grouped = layer(x).y
        layer.decode_max_tokens = 8
        decode = layer(x).y
    from tolerances import assert_close
    assert_close(decode, grouped)


def test_latent_config_validation() -> None:
    with pytest.raises(ValueError, match=r"moe\.latent_dim=-1"):
        MoEConfig(latent_dim=-1)
    with pytest.raises(ValueError, match=r"moe\.latent_norm=True: needs latent_dim"):
        MoEConfig(latent_norm=True)
    with pytest.raises(ValueError, match=r"model\.moe\.latent_dim=64: must be <= d_model=32"):
        ModelConfig(d_model=32, n_heads=2, moe=MoEConfig(latent_dim=64))
    with pytest.raises(ValueError, match=r"model\.moe\.latent_dim=40: must be a multiple of 32"):
        ModelConfig(d_model=64, n_heads=2, moe=MoEConfig(latent_dim=40, precision="mxfp8", d_expert=64))


@pytest.mark.parametrize("recompute", [[], ["layer"], ["moe"], ["moe_act"]], ids=lambda r: "+".join(r) or "none")
def test_latent_model_against_reference_and_recompute(recompute: list[str]) -> None:
    check_model(model_cfg("model.moe.latent_dim=16", "model.moe.latent_norm=true"), recompute)
