"""The model of `dropless bench train` (bench/train_step.py), in both libraries: its shapes, the
Qwen3-MoE config.json it is built from, dropless's model config from that file, transformers' model
holding the same weights (hf/mapping.py's table), and the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..config import ModelConfig
from ..hf import mapping
from ..model import MoEModel
from . import hf_baseline


@dataclass(frozen=True)
class Shape:
    n_layers: int
    d_model: int
    num_experts: int
    top_k: int
    d_expert: int
    seq_len: int
    batch: int
    n_heads: int  # head width D / H = 64 at small and medium (Qwen3's head_dim is 128; 64 keeps H >= 8)
    vocab: int


# "tiny" is for the tests. medium has 1 layer, not small's 4: a medium layer holds 100M expert
# parameters, 1.6 GB per model with gradients and AdamW state, and the bench holds two models
# (dropless's, shared by its two rows, and transformers'); on a shared 23 GB machine
# (other jobs using 12-19 GB) a 2-layer run grew past 6.8 GB resident before its first timed step and
# was stopped. Every layer is the same, so one layer keeps the per-layer comparison; the head and the
# loss weigh more in the step than with 4.
SHAPES = {
    "tiny": Shape(2, 32, 8, 2, 16, seq_len=16, batch=2, n_heads=2, vocab=64),
    "small": Shape(4, 512, 32, 4, 256, seq_len=512, batch=8, n_heads=8, vocab=8192),
    "medium": Shape(1, 1024, 64, 8, 512, seq_len=512, batch=8, n_heads=16, vocab=8192),
}
def hf_config_dict(shape: Shape) -> dict:
    """The Qwen3-MoE config.json of the benchmark model (every layer MoE)."""
    return {"model_type": "qwen3_moe", "vocab_size": shape.vocab, "hidden_size": shape.d_model,
            "num_hidden_layers": shape.n_layers, "num_attention_heads": shape.n_heads,
            "num_key_value_heads": shape.n_heads, "head_dim": shape.d_model // shape.n_heads,
            "num_experts": shape.num_experts, "num_experts_per_tok": shape.top_k,
            "moe_intermediate_size": shape.d_expert, "intermediate_size": 4 * shape.d_expert,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": shape.seq_len, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": False,
            "attention_bias": False, "router_aux_loss_coef": 0.001, "initializer_range": 0.02}


def model_config(shape: Shape, align: int = 1) -> ModelConfig:
    """`align`: model.moe.align of the dropless model (the per-expert row padding of its routing
    plan; 1, the default, pads nothing)."""
    cfg = mapping.model_config(hf_config_dict(shape))[0]
    return replace(cfg, moe=replace(cfg.moe, align=align)) if align != 1 else cfg


def build_hf(model: MoEModel, shape: Shape) -> nn.Module:
    """transformers' Qwen3MoeForCausalLM with `model`'s weights (grouped_mm experts, SDPA)."""
    hf_baseline._transformers()  # the optional-dependency error, if any
    import transformers

    hf_dict = {k: v for k, v in hf_config_dict(shape).items() if k != "model_type"}
    cfg = transformers.Qwen3MoeConfig(**hf_dict, output_router_logits=True, use_cache=False)
    hf = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, experts_implementation="grouped_mm", attn_implementation="sdpa")
    table = {s.hf_name: s for s in mapping.slots(model, "qwen3_moe") + mapping.fused_slots(model, "qwen3_moe")}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in hf.named_parameters():
            s = table[name]  # a KeyError here is a name the table does not know: a real mismatch
            src = params[s.param][s.index] if s.index else params[s.param]
            p.copy_(src.transpose(-1, -2) if s.transpose else src)
    return hf.train()


def batch(shape: Shape, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens_BS and dropless's targets_BS: the next token, -100 (ignored) at the last position, which
    is what transformers' labels=input_ids computes after its shift."""
    g = torch.Generator().manual_seed(seed)
    tokens_BS = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len), generator=g)
    targets_BS = torch.cat([tokens_BS[:, 1:], torch.full((shape.batch, 1), -100)], dim=1)
    return tokens_BS, targets_BS
