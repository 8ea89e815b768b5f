"""Generation with the model knobs of docs/model_knobs.md: the KV-cache path against the full forward
(logits) and against the recompute path (greedy tokens), for identity experts and LatentMoE (the
decode-size calls take their own expert path), and the MTP modules stay out of generation."""

from __future__ import annotations

import pytest
import torch

from dataclasses import replace

from dropless.layers import mtp
from dropless.model import MoEModel
from dropless.serve.generate import generate
from test_generate import PROMPTS
from test_kv_cache import cached_logits, small_model
from tolerances import KV_DECODE, assert_close

# (model fields, moe fields)
KNOBS = {
    "identity": ({}, dict(n_identity_experts=2)),
    "latent": ({}, dict(latent_dim=16, latent_norm=True)),
    "latent_identity": ({}, dict(latent_dim=16, n_identity_experts=1)),
    "parallel_block": (dict(block="parallel_moe"), {}),
    "moe_layer_freq": (dict(n_layers=4, moe_layer_freq=[1, 3]), {}),
    "mtp": (dict(mtp_depth=2), {}),
}


def knob_model(knob: str) -> MoEModel:
    model_kw, moe_kw = KNOBS[knob]
    cfg = small_model(**moe_kw).cfg
    torch.manual_seed(0)
    return MoEModel(replace(cfg, **model_kw)).eval()


@pytest.mark.parametrize("knob", list(KNOBS))
def test_knob_cache_matches_full_forward_and_greedy(knob: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = knob_model(knob)
    monkeypatch.setattr(mtp.MTPModule, "forward", lambda *a: pytest.fail("an MTP module ran in generation"))
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 62, (n,), generator=g) for n in (20, 12)]
    got = cached_logits(model, seqs, [12, 3], 8)
    with torch.no_grad():
        for b, s in enumerate(seqs):
            full = model(s[:[12, 3][b] + 8].unsqueeze(0)).logits[0]
            assert_close(got[b], full, KV_DECODE, msg=f"sequence {b}")
        if knob == "identity":  # the test says something only if identity experts are chosen
            ids = torch.cat([m.ids_TK for m in model(seqs[0].unsqueeze(0)).moe])
            assert (ids >= model.cfg.moe.num_experts).any()
    cached = generate(model, PROMPTS, 12, temperature=0)
    assert cached.tokens == generate(model, PROMPTS, 12, temperature=0, use_cache=False).tokens
