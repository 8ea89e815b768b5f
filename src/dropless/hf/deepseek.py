"""Hugging Face <-> dropless for DeepSeek-V3: its config translation and its part of the tensor map
(hf/mapping.py holds the table and the other families; this file only what DeepSeek adds).

Legend: E routed experts, D model width, F one routed expert's hidden width, Fs the shared experts'
width (n_shared_experts x F), H heads, Rq query rank, Rkv key/value latent width, Dn / Dr the
non-rotary / rotary part of a query-key head, Dqk = Dn + Dr, Dv value head width.

    HF (per layer i, self_attn.)                 dropless (blocks.i.attn., layers/mla.py)
    q_a_proj.weight (.bias)      [Rq, D]         q_a.weight (.bias)       (q_lora_rank > 0)
    q_a_layernorm.weight         [Rq]            q_norm.weight
    q_b_proj.weight              [H Dqk, Rq]     q_b.weight
    q_proj.weight                [H Dqk, D]      q_proj.weight            (q_lora_rank null)
    kv_a_proj_with_mqa.weight    [Rkv + Dr, D]   kv_a.weight (.bias)
    kv_a_layernorm.weight        [Rkv]           kv_norm.weight
    kv_b_proj.weight             [H (Dn+Dv), Rkv] kv_b.weight
    o_proj.weight (.bias)        [D, H Dv]       out.weight (.bias)
    HF (mlp.)                                    dropless (blocks.i.ffn.)
    gate.weight                  [E, D]          router.weight
    gate.e_score_correction_bias [E]             router.expert_bias       (a buffer on both sides)
    experts.{e}.gate/up/down_proj                experts.w_gate_up_EDF / w_down_EFD, as Qwen3-MoE
    shared_experts.gate_proj / up_proj  [Fs, D]  shared.gate_up.weight rows [gate | up]
    shared_experts.down_proj     [D, Fs]         shared.down.weight
    gate_proj / up_proj / down_proj (first_k_dense_replace dense layers): ffn.gate_up / ffn.down

Routing, exactly transformers' DeepseekV3TopkRouter: sigmoid scores; selection on score + the
correction bias; group-limited (n_group groups, each scored by the sum of its two best biased
scores, the best topk_group kept: ops/routing.group_limited_mask is that rule); the weights are the
unbiased scores of the chosen experts, renormalised when norm_topk_prob, times
routed_scaling_factor. dropless: score_func "sigmoid", use_expert_bias, n_groups / topk_groups,
renormalize, scaling_factor (norm_top_k = 1 for a renormalised top-1, as in mapping.py).

Balancing, the family's rule (DeepSeek-V3 report, section 2.1.2): the loss-free bias step
(bias_update_rate 1e-3, the report's gamma) plus the complementary sequence-wise aux loss (1e-4, the
report's alpha); no micro-batch aux loss and no z-loss. transformers trains with neither.

Rotary: plain or YaRN (`rope_parameters` or DeepSeek's own `rope_scaling` spelling, with
`mscale` / `mscale_all_dim`: the cos/sin factor and the softmax-scale factor of layers/rotary.py;
read and written by hf/rope.py).

Defaults: a key the config.json omits is DeepseekV3Config's default (hf/defaults.py): 8 groups of
which 4 are eligible, routed_scaling_factor 2.5, three dense layers, a query rank of 1536.

Not expressible, refused by name: other rotary scalings (linear, dynamic, ...) and yarn's explicit
`attention_factor` / `partial_rotary_factor` / `truncate: false` (hf/rope.py), moe_layer_freq != 1, num_key_value_heads != num_attention_heads (transformers' MLA would not
run either), n_shared_experts = 0, a scoring function other than sigmoid, a topk_method other than
"noaux_tc", groups of fewer than two experts.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..config import ModelConfig
from ..moe_config import BalanceConfig, MoEConfig, RouterConfig
from . import rope
from .defaults import Fields, refuse

BIAS_UPDATE_RATE = 1e-3
SEQ_AUX_LOSS_COEFF = 1e-4


def model_config(f: Fields) -> ModelConfig:
    """The dropless config of a DeepSeek-V3 config.json (read through `f`: transformers' defaults)."""
    n_layers, H = f("num_hidden_layers"), f("num_attention_heads")
    kv = f("num_key_value_heads")
    if kv is not None and kv != H:
        refuse("num_key_value_heads", kv, f"MLA has one key/value head per query head (num_attention_heads={H})")
    if int(f("moe_layer_freq")) != 1:
        refuse("moe_layer_freq", f("moe_layer_freq"), "only every layer after first_k_dense_replace is MoE (1)")
    if f("scoring_func") != "sigmoid":
        refuse("scoring_func", f("scoring_func"), "DeepSeek-V3 routes on sigmoid scores")
    if f("topk_method") != "noaux_tc":
        refuse("topk_method", f("topk_method"), "only 'noaux_tc' (group-limited, bias-corrected top-k)")
    n_shared = f("n_shared_experts")
    if n_shared < 1:
        refuse("n_shared_experts", n_shared, "at least one shared expert (transformers always builds them)")
    E, K = f("n_routed_experts"), f("num_experts_per_tok")
    G, TG = int(f("n_group")), int(f("topk_group"))
    if G > 1 and E // G < 2:
        refuse("n_group", G, f"groups of {E // G} expert: transformers scores a group by its two best")
    n_dense = f("first_k_dense_replace")
    if n_dense >= n_layers:
        refuse("first_k_dense_replace", n_dense, "no MoE layer: a dense model (dropless imports MoE models)")
    renorm = bool(f("norm_topk_prob"))
    router = RouterConfig(score_func="sigmoid", renormalize=renorm, norm_top_k=1 if (K == 1 and renorm) else None,
                          scaling_factor=float(f("routed_scaling_factor")), n_groups=G,
                          topk_groups=TG, use_expert_bias=True)
    balance = BalanceConfig(aux_loss_coeff=0.0, seq_aux_loss_coeff=SEQ_AUX_LOSS_COEFF, z_loss_coeff=0.0,
                            bias_update_rate=BIAS_UPDATE_RATE)
    F = f("moe_intermediate_size")
    moe = MoEConfig(num_experts=E, top_k=K, d_expert=F, activation="swiglu", router=router, balance=balance,
                    n_shared_experts=n_shared, d_shared=F)
    rope_dim, nope = f("qk_rope_head_dim"), f("qk_nope_head_dim")
    theta, yarn = rope.read(f, yarn_ok=True)
    return ModelConfig(
        vocab_size=f("vocab_size"), d_model=f("hidden_size"), n_layers=n_layers, n_heads=H,
        head_dim=nope + rope_dim, attention="mla", q_lora_rank=int(f("q_lora_rank") or 0),
        kv_lora_rank=f("kv_lora_rank"), rope_head_dim=rope_dim, v_head_dim=f("v_head_dim"),
        rope_interleave=bool(f("rope_interleave")), attn_bias=bool(f("attention_bias")),
        max_seq_len=f("max_position_embeddings"), n_dense_layers=n_dense, d_ff_dense=f("intermediate_size"),
        tie_embeddings=bool(f("tie_word_embeddings")), rope_theta=theta, rope_yarn=yarn,
        norm_eps=float(f("rms_norm_eps")), init_std=float(f("initializer_range")), moe=moe)


def checks(cfg: ModelConfig) -> list[tuple[str, Any, bool, str]]:
    """(field, value, refused?, why) for what DeepSeek-V3 cannot express (beyond mapping.py's common list)."""
    m, r = cfg.moe, cfg.moe.router
    return [
        ("model.attention", cfg.attention, cfg.attention != "mla", "multi-head latent attention only"),
        ("model.moe.router.score_func", r.score_func, r.score_func != "sigmoid", "sigmoid router scores only"),
        ("model.moe.router.use_expert_bias", r.use_expert_bias, not r.use_expert_bias,
         "the router always has its correction bias"),
        ("model.moe.n_shared_experts", m.n_shared_experts, m.shared_width == 0 or m.shared_width % m.d_expert,
         "shared experts of n_shared_experts x moe_intermediate_size width, at least one"),
        ("model.moe.router.n_groups", r.n_groups, r.n_groups > 1 and m.num_experts // r.n_groups < 2,
         "groups of at least two experts"),
    ]


def hf_config(attn: torch.nn.Module, moe: torch.nn.Module, n_dense: int, d_ff_dense: int) -> dict[str, Any]:
    """DeepSeek-V3's own fields of the config.json, read from the built modules (an MLA block's
    `attn`, an MoE layer `moe`); mapping.hf_config adds the common ones."""
    r = moe.cfg.router
    E, F, _ = moe.experts.w_down_EFD.shape
    q_a = getattr(attn, "q_a", None)
    return {"n_routed_experts": E, "moe_intermediate_size": F,
            "n_shared_experts": moe.shared.down.weight.shape[1] // F, "first_k_dense_replace": n_dense,
            "intermediate_size": d_ff_dense, "routed_scaling_factor": r.scaling_factor,
            "n_group": r.n_groups, "topk_group": r.topk_groups,
            "q_lora_rank": q_a.out_features if q_a is not None else None, "kv_lora_rank": attn.kv_rank,
            "qk_rope_head_dim": attn.rope_dim, "qk_nope_head_dim": attn.nope_dim, "v_head_dim": attn.v_dim,
            "rope_interleave": attn.interleave, "attention_bias": attn.out.bias is not None,
            "num_nextn_predict_layers": 0}


# HF self_attn.<name> -> dropless attn.<name>, each whole (the module note's table); a pair is in the
# checkpoint when the built model has the parameter (q_a or q_proj; biases)
ATTENTION = (("q_a_proj.weight", "q_a.weight"), ("q_a_proj.bias", "q_a.bias"),
             ("q_a_layernorm.weight", "q_norm.weight"), ("q_b_proj.weight", "q_b.weight"),
             ("q_proj.weight", "q_proj.weight"), ("kv_a_proj_with_mqa.weight", "kv_a.weight"),
             ("kv_a_proj_with_mqa.bias", "kv_a.bias"), ("kv_a_layernorm.weight", "kv_norm.weight"),
             ("kv_b_proj.weight", "kv_b.weight"), ("o_proj.weight", "out.weight"), ("o_proj.bias", "out.bias"))


def attention_slots(hf: str, dl: str, slot: Callable[..., Any]) -> list[Any]:
    """The MLA tensors of one layer (`hf`, `dl`: the layer prefixes; `slot`: mapping's slot maker)."""
    a, b = hf + "self_attn.", dl + "attn."
    return [slot(a + h, b + d) for h, d in ATTENTION if b + d in slot]
