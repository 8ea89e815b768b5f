"""Tiny random-weight Hugging Face checkpoints for the hf tests, built with transformers' own config
and model classes and written with `save_pretrained` (no download). Shards are kept small so that
every checkpoint is sharded and read through its index file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")

import torch  # noqa: E402

from dropless.data.tokenizer import train_byte_bpe  # noqa: E402

VOCAB = 320  # the tokenizer's 256 byte symbols + a few merges, below it


def qwen3_config(**kw: Any) -> Any:
    """GQA (4 query heads on 2 key/value heads), q/k norm, an explicit head_dim != d/H, a dense first
    layer (mlp_only_layers), untied head, a non-default rope theta and eps."""
    args = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=12, moe_intermediate_size=24,
                num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                rms_norm_eps=1e-5, tie_word_embeddings=False, router_aux_loss_coef=0.01)
    args.update(kw)
    return transformers.Qwen3MoeConfig(**args)


def mixtral_config(**kw: Any) -> Any:
    args = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                max_position_embeddings=64, router_aux_loss_coef=0.02)
    args.update(kw)
    return transformers.MixtralConfig(**args)


def deepseek_config(**kw: Any) -> Any:
    """Multi-head latent attention with a low-rank query (q_lora_rank; q_lora_rank=None for the plain
    projection), value heads narrower than query/key heads, DeepSeek's interleaved rotary layout;
    8 routed experts in 4 groups of which 2 are eligible, top-3, 2 shared experts, a dense first layer
    (first_k_dense_replace), routed_scaling_factor 2.5, one MTP layer declared (none saved by
    transformers), eps 1e-5 (the latent norms keep transformers' 1e-6)."""
    args = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=12,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1,
                q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5,
                routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=64,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
    args.update(kw)
    return transformers.DeepseekV3Config(**args)


def write_tokenizer(folder: Path, added: int = 0) -> None:
    """A byte-level BPE tokenizer.json of at most VOCAB - 8 tokens trained on a few lines of Python,
    plus `added` added tokens."""
    text = ["def f(x):\n    return x + 1\n", "import os\nimport sys\n", "class A:\n    pass\n",
            "for i in range(10):\n    print(i, i * i, str(i).upper())\n", "with open(path) as fh:\n"] * 20
    train_byte_bpe(text, folder, VOCAB - 8, added=[f"<extra_{i}>" for i in range(added)])


def save_hf(config: Any, folder: Path, seed: int = 0, tokenizer: bool = True) -> Any:
    """A random-weight model of `config` saved to `folder` in fp32 with ~8 kB shards; returns it
    (eval mode). Norm weights are randomised too, so a swapped or missing norm shows."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():  # DeepSeek's routing correction: must steer the choice
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(folder, max_shard_size="8KB")
    if tokenizer:
        write_tokenizer(folder)
    return model
