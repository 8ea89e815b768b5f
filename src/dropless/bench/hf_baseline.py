"""The Hugging Face baseline for the layer benchmark: transformers' Qwen3-MoE sparse block.

Legend: T tokens, D model width, E experts, K experts per token, F expert width.

How transformers (5.x) picks its experts kernel: `Qwen3MoeExperts` is decorated with
`@use_experts_implementation`, whose forward looks up `config._experts_implementation` in
`ALL_EXPERTS_FUNCTIONS` ("grouped_mm", "batched_mm", ...; "eager" or None falls back to the
per-expert Python loop). A full model resolves None to "grouped_mm" in
`PreTrainedModel.get_correct_experts_implementation`, so grouped_mm is what every full model runs by
default; a block built on its own never passes through that code, so here the config is built with
`experts_implementation="grouped_mm"`, and `uses_grouped_mm` checks that the kernel really runs.

Same routing as the dropless layer: the block's router (`Qwen3MoeTopKRouter`) is given a forward
that computes its logits and softmax as usual but takes the expert ids from the benchmark instead of
its own top-k (the weights are its probabilities at those ids, renormalised as with
norm_topk_prob=True), so its router still receives gradients, like `layer(x, replay_ids=ids)`.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
import torch.nn.functional as F

from ..layers.moe import MoELayer
from ..model import Block


def _transformers():
    try:
        from transformers.models.qwen3_moe import configuration_qwen3_moe, modeling_qwen3_moe
    except ImportError as err:  # the one place this optional dependency is imported
        raise ImportError("the hf_transformers variant needs transformers: pip install 'dropless[hf]'") from err
    return configuration_qwen3_moe, modeling_qwen3_moe


def available() -> bool:
    try:
        _transformers()
    except ImportError:
        return False
    return True


def _forced_router_forward(ids_TK: torch.Tensor):
    def forward(self, hidden_states: torch.Tensor):
        h_TD = hidden_states.reshape(-1, self.hidden_dim)
        logits_TE = F.linear(h_TD, self.weight)
        probs_TE = torch.softmax(logits_TE, dtype=torch.float, dim=-1)
        w_TK = probs_TE.gather(1, ids_TK)
        if self.norm_topk_prob:
            w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True)
        return logits_TE, w_TK.to(logits_TE.dtype), ids_TK

    return forward


def _config(layer: MoELayer, **attention):
    configuration, _ = _transformers()
    cfg = layer.cfg
    D = layer.router.weight.shape[1]
    return configuration.Qwen3MoeConfig(
        hidden_size=D, moe_intermediate_size=cfg.d_expert, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k, norm_topk_prob=True, hidden_act="silu",
        experts_implementation="grouped_mm", **attention)


def build_block(layer: MoELayer, ids_TK: torch.Tensor, dtype: torch.dtype) -> torch.nn.Module:
    """A Qwen3MoeSparseMoeBlock with `layer`'s shape and weights, routed by `ids_TK`, in `dtype`."""
    _, modeling = _transformers()
    block = modeling.Qwen3MoeSparseMoeBlock(_config(layer))
    with torch.no_grad():
        # HF stores weights as (out, in): gate_up (E, 2F, D) with gate first, down (E, D, F).
        block.experts.gate_up_proj.copy_(layer.experts.w_gate_up_EDF.transpose(1, 2))
        block.experts.down_proj.copy_(layer.experts.w_down_EFD.transpose(1, 2))
        block.gate.weight.copy_(layer.router.weight)
    block.gate.forward = types.MethodType(_forced_router_forward(ids_TK), block.gate)
    return block.to(dtype)


def uses_grouped_mm(block: torch.nn.Module, x_TD: torch.Tensor) -> bool:
    """Run the block once under the profiler and report whether aten grouped_mm ran."""
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        block(x_TD.unsqueeze(0))
    return any("grouped_mm" in e.key for e in prof.key_averages())


def build_decoder_layer(block: Block, ids_TK: torch.Tensor, dtype: torch.dtype
                        ) -> tuple[torch.nn.Module, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    """transformers' Qwen3MoeDecoderLayer with `block`'s shape and weights (SDPA attention, the MoE
    part from `build_block`), and a function of (x_BSD, cos_SF, sin_SF) that runs it like `Block`. Not the same
    function: Qwen3 normalises each head's q and k (q_norm, k_norm, here with unit weights), which
    dropless's attention does not; every other weight is `block`'s."""
    _, modeling = _transformers()
    attn = block.attn
    D, H = attn.out.weight.shape[0], attn.n_heads
    hf_cfg = _config(block.ffn, num_attention_heads=H, num_key_value_heads=H, head_dim=D // H,
                     rms_norm_eps=block.attn_norm.eps, attn_implementation="sdpa")
    hf = modeling.Qwen3MoeDecoderLayer(hf_cfg, layer_idx=0)
    with torch.no_grad():
        q_DD, k_DD, v_DD = attn.qkv.weight.chunk(3, dim=0)  # dropless's qkv rows: q, then k, then v
        for proj, w in ((hf.self_attn.q_proj, q_DD), (hf.self_attn.k_proj, k_DD),
                        (hf.self_attn.v_proj, v_DD), (hf.self_attn.o_proj, attn.out.weight)):
            proj.weight.copy_(w)
        hf.input_layernorm.weight.copy_(block.attn_norm.weight)
        hf.post_attention_layernorm.weight.copy_(block.ffn_norm.weight)
    hf.mlp = build_block(block.ffn, ids_TK, dtype)
    hf.to(dtype)

    def forward(x_BSD: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor) -> torch.Tensor:
        # transformers' tables repeat the frequencies over both halves of the head ([S, Dh], the
        # same rotate-half convention as dropless's apply_rotary)
        cos, sin = (torch.cat([t, t], dim=-1).unsqueeze(0).to(dtype) for t in (cos_SF, sin_SF))
        return hf(x_BSD, position_embeddings=(cos, sin))

    return hf, forward
