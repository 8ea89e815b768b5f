"""The attention variants the Hugging Face families need (model.py `Attention`): grouped-query heads,
per-head q/k RMSNorm, an explicit head width and projection biases, against a plain per-head
reference, and through the KV cache (layers/kv_cache.py stores the Hkv key/value heads only).
Parity with transformers itself is in test_hf_parity.py; these run without it."""

from __future__ import annotations

import math

import pytest
import torch

from dropless.config import ModelConfig, MoEConfig
from dropless.layers.kv_cache import KVCache
from dropless.model import Attention, MoEModel, apply_rotary, rotary_tables
from tolerances import KV_DECODE, REFERENCE, assert_close

# H=6 query heads on Hkv=2 (3 per group, so a wrong grouping - interleaved instead of blocked -
# pairs queries with the wrong keys), Dh=10 != D/H, q/k norm, biases: every switch on at once.
VARIANT = dict(d_model=24, n_heads=6, n_kv_heads=2, head_dim=10, qk_norm=True, attn_bias=True, norm_eps=1e-5)


def attention_reference(attn: Attention, x_BSD: torch.Tensor, cos_SF: torch.Tensor,
                        sin_SF: torch.Tensor) -> torch.Tensor:
    """Per query head: its rows of the fused projection, its group's key/value head (h // (H/Hkv)),
    the norms, the rotary, an explicit causal softmax; then the output projection."""
    H, Hkv, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
    B, S, _ = x_BSD.shape
    W, b = attn.qkv.weight, attn.qkv.bias
    proj = torch.nn.functional.linear(x_BSD, W, b)  # B S (H + 2 Hkv) Dh

    def head(i: int) -> torch.Tensor:
        return proj[..., i * Dh:(i + 1) * Dh]

    def rms(t: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + norm.eps) * norm.weight

    causal = torch.ones(S, S, dtype=torch.bool).tril()
    outs = []
    for h in range(H):
        g = h // (H // Hkv)
        q = apply_rotary(rms(head(h), attn.q_norm).unsqueeze(1), cos_SF, sin_SF)[:, 0]
        k = apply_rotary(rms(head(H + g), attn.k_norm).unsqueeze(1), cos_SF, sin_SF)[:, 0]
        v = head(H + Hkv + g)
        s = (q @ k.transpose(1, 2)) / math.sqrt(Dh)
        outs.append(s.masked_fill(~causal, float("-inf")).softmax(-1) @ v)
    return attn.out(torch.cat(outs, dim=-1))


def test_grouped_query_attention_matches_per_head_reference() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(**VARIANT)
    attn = Attention(cfg)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 9, cfg.d_model, requires_grad=True)
    cos, sin = rotary_tables(9, cfg.head_width, cfg.rope_theta)
    y = attn(x, cos, sin)
    ref = attention_reference(attn, x, cos, sin)
    assert_close(y, ref, REFERENCE[torch.float32], "output")
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *attn.parameters()], dy)
    want = torch.autograd.grad(ref, [x, *attn.parameters()], dy)
    names = ["x"] + [n for n, _ in attn.named_parameters()]
    for n, a, b in zip(names, got, want):
        assert_close(a, b, REFERENCE[torch.float32], f"gradient of {n}")


def test_config_validates_head_fields() -> None:
    with pytest.raises(ValueError, match="model.n_kv_heads=4"):
        ModelConfig(d_model=24, n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="model.head_dim=5"):
        ModelConfig(d_model=24, n_heads=6, head_dim=5)
    assert ModelConfig(d_model=30, n_heads=4, head_dim=8).head_width == 8  # d/H need not divide then


def test_kv_cache_holds_kv_heads_and_decodes_like_the_full_forward() -> None:
    """Left-padded batch, one prefill and cached steps (serve's path) against the plain forward of
    each sequence alone, with every attention switch on."""
    from serve.test_kv_cache import cached_logits

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, n_layers=3, max_seq_len=64, n_dense_layers=1, d_ff_dense=48,
                      init_std=0.5, moe=MoEConfig(num_experts=4, top_k=2, d_expert=16), **VARIANT)
    model = MoEModel(cfg).eval()
    cache = KVCache.for_model(model, 2, 8)
    assert cache.layers[0].shape == (2, 2, 8, 10)  # B, Hkv, capacity, Dh
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 62, (n,), generator=g) for n in (18, 12)]
    prompt_lens, steps = [11, 4], 6
    got = cached_logits(model, seqs, prompt_lens, steps)
    with torch.no_grad():
        for b, s in enumerate(seqs):
            full = model(s[:prompt_lens[b] + steps].unsqueeze(0)).logits[0]
            assert_close(got[b], full, KV_DECODE, msg=f"sequence {b}")


@pytest.mark.parametrize("modes", [["layer"], ["attn", "norm"]])
def test_recompute_with_attention_variants_is_bit_identical(modes: list[str]) -> None:
    """Activation recompute (layers/recompute.py) reruns the same attention on the same inputs: the
    loss and every gradient equal the plain backward's bit for bit, with every switch on."""
    grads = []
    for recompute in ([], modes):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=64, n_layers=2, max_seq_len=32, n_dense_layers=1, d_ff_dense=48,
                          moe=MoEConfig(num_experts=4, top_k=2, d_expert=16), recompute=recompute, **VARIANT)
        model = MoEModel(cfg)
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        out = model(x, x)
        out.loss.backward()
        grads.append([out.loss] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
