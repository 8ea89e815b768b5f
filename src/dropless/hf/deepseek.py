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
`mscale` / `mscale_all_dim`: the cos/sin factor and the softmax-scale factor of layers/rotary.py).

Not expressible, refused by name: other rotary scalings (linear, dynamic, ...) and yarn's explicit
`attention_factor` / `partial_rotary_factor` / `truncate: false`, moe_layer_freq != 1, num_key_value_heads != num_attention_heads (transformers' MLA would not
run either), n_shared_experts = 0, a scoring function other than sigmoid, a topk_method other than
"noaux_tc", groups of fewer than two experts.
"""

from __future__ import annotations

from typing import Any, Callable

from ..config import ModelConfig, YarnConfig
from ..moe_config import BalanceConfig, MoEConfig, RouterConfig

BIAS_UPDATE_RATE = 1e-3
SEQ_AUX_LOSS_COEFF = 1e-4


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def rope(hf: dict[str, Any], refuse: Callable[..., None], plain_theta: Callable[[dict[str, Any]], float]
         ) -> tuple[float, YarnConfig]:
    """Rotary base and YaRN scaling from `rope_parameters` (transformers 5) or `rope_scaling` +
    `rope_theta` (4.x and DeepSeek's own config.json); other scalings are refused by name."""
    params, where = hf.get("rope_parameters"), "rope_parameters"
    if params is None and hf.get("rope_scaling") is not None:
        params, where = {**hf["rope_scaling"], "rope_theta": hf.get("rope_theta", 10000.0)}, "rope_scaling"
    kind = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    if kind != "yarn":
        return plain_theta(hf), YarnConfig()
    for key in ("attention_factor", "partial_rotary_factor"):
        if params.get(key) is not None:
            refuse(f"{where}.{key}", params[key], "not supported with yarn")
    if params.get("truncate", True) is not True:
        refuse(f"{where}.truncate", params["truncate"], "only the truncated correction range")
    original = params.get("original_max_position_embeddings")
    if original is None:
        refuse(f"{where}.original_max_position_embeddings", None, "yarn needs it")
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    yarn = YarnConfig(factor=float(factor), original_max_seq_len=int(original),
                      beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                      mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0))
    return float(params.get("rope_theta", 10000.0)), yarn


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    y = cfg.rope_yarn
    if y.factor == 1.0:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": y.factor,
            "original_max_position_embeddings": y.original_max_seq_len, "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow, "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim}


def model_config(hf: dict[str, Any], field: Callable[..., Any], refuse: Callable[..., None],
                 plain_theta: Callable[[dict[str, Any]], float]) -> ModelConfig:
    """The dropless config of a DeepSeek-V3 config.json (`field` and `refuse` are mapping.py's)."""
    n_layers, H = field(hf, "num_hidden_layers"), field(hf, "num_attention_heads")
    if field(hf, "num_key_value_heads", H) != H:
        refuse("num_key_value_heads", hf["num_key_value_heads"], f"MLA has one key/value head per query "
               f"head (num_attention_heads={H})")
    if int(hf.get("moe_layer_freq", 1) or 1) != 1:
        refuse("moe_layer_freq", hf["moe_layer_freq"], "only every layer after first_k_dense_replace is MoE (1)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        refuse("scoring_func", hf["scoring_func"], "DeepSeek-V3 routes on sigmoid scores")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        refuse("topk_method", hf["topk_method"], "only 'noaux_tc' (group-limited, bias-corrected top-k)")
    n_shared = field(hf, "n_shared_experts")
    if n_shared < 1:
        refuse("n_shared_experts", n_shared, "at least one shared expert (transformers always builds them)")
    E, K = field(hf, "n_routed_experts", hf.get("num_local_experts")), field(hf, "num_experts_per_tok")
    G, TG = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if G > 1 and E // G < 2:
        refuse("n_group", G, f"groups of {E // G} expert: transformers scores a group by its two best")
    n_dense = field(hf, "first_k_dense_replace", 0)
    if n_dense >= n_layers:
        refuse("first_k_dense_replace", n_dense, "no MoE layer: a dense model (dropless imports MoE models)")
    renorm = bool(hf.get("norm_topk_prob", True))
    router = RouterConfig(score_func="sigmoid", renormalize=renorm, norm_top_k=1 if (K == 1 and renorm) else None,
                          scaling_factor=float(field(hf, "routed_scaling_factor", 1.0)), n_groups=G,
                          topk_groups=TG, use_expert_bias=True)
    balance = BalanceConfig(aux_loss_coeff=0.0, seq_aux_loss_coeff=SEQ_AUX_LOSS_COEFF, z_loss_coeff=0.0,
                            bias_update_rate=BIAS_UPDATE_RATE)
    F = field(hf, "moe_intermediate_size")
    moe = MoEConfig(num_experts=E, top_k=K, d_expert=F, activation="swiglu", router=router, balance=balance,
                    n_shared_experts=n_shared, d_shared=F)
    rope_dim, nope = field(hf, "qk_rope_head_dim"), field(hf, "qk_nope_head_dim")
    theta, yarn = rope(hf, refuse, plain_theta)
    return ModelConfig(
        vocab_size=field(hf, "vocab_size"), d_model=field(hf, "hidden_size"), n_layers=n_layers, n_heads=H,
        head_dim=nope + rope_dim, attention="mla", q_lora_rank=int(hf.get("q_lora_rank") or 0),
        kv_lora_rank=field(hf, "kv_lora_rank"), rope_head_dim=rope_dim, v_head_dim=field(hf, "v_head_dim"),
        rope_interleave=bool(hf.get("rope_interleave", True)), attn_bias=bool(hf.get("attention_bias", False)),
        max_seq_len=field(hf, "max_position_embeddings"), n_dense_layers=n_dense,
        d_ff_dense=int(hf.get("intermediate_size") or 1), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=theta, rope_yarn=yarn, norm_eps=float(field(hf, "rms_norm_eps")),
        init_std=float(hf.get("initializer_range", 0.02)), moe=moe)


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


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """DeepSeek-V3's own fields of the config.json (mapping.hf_config adds the common ones)."""
    m, r = cfg.moe, cfg.moe.router
    return {"n_routed_experts": m.num_experts, "moe_intermediate_size": m.d_expert,
            "n_shared_experts": m.shared_width // m.d_expert, "first_k_dense_replace": cfg.n_dense_layers,
            "intermediate_size": cfg.d_ff_dense, "routed_scaling_factor": r.scaling_factor,
            "n_group": r.n_groups, "topk_group": r.topk_groups, "q_lora_rank": cfg.q_lora_rank or None,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.rope_head_dim,
            "qk_nope_head_dim": cfg.head_width - cfg.rope_head_dim, "v_head_dim": cfg.value_width,
            "rope_interleave": cfg.rope_interleave, "rope_parameters": rope_parameters(cfg), "attention_bias": cfg.attn_bias, "num_nextn_predict_layers": 0}


def attention_slots(cfg: ModelConfig, hf: str, dl: str, slot: Callable[..., Any]) -> list[Any]:
    """The MLA tensors of one layer (`hf`, `dl`: the layer prefixes; `slot`: mapping.Slot)."""
    D, H, Dqk, Dr, Dv, Rkv = cfg.d_model, cfg.n_heads, cfg.head_width, cfg.rope_head_dim, cfg.value_width, cfg.kv_lora_rank
    Dn, Rq, a, b = Dqk - Dr, cfg.q_lora_rank, hf + "self_attn.", dl + "attn."
    out = []
    if Rq:
        out += [slot(a + "q_a_proj.weight", (Rq, D), b + "q_a.weight"),
                slot(a + "q_a_layernorm.weight", (Rq,), b + "q_norm.weight"),
                slot(a + "q_b_proj.weight", (H * Dqk, Rq), b + "q_b.weight")]
        if cfg.attn_bias:
            out.append(slot(a + "q_a_proj.bias", (Rq,), b + "q_a.bias"))
    else:
        out.append(slot(a + "q_proj.weight", (H * Dqk, D), b + "q_proj.weight"))
    out += [slot(a + "kv_a_proj_with_mqa.weight", (Rkv + Dr, D), b + "kv_a.weight"),
            slot(a + "kv_a_layernorm.weight", (Rkv,), b + "kv_norm.weight"),
            slot(a + "kv_b_proj.weight", (H * (Dn + Dv), Rkv), b + "kv_b.weight"),
            slot(a + "o_proj.weight", (D, H * Dv), b + "out.weight")]
    if cfg.attn_bias:
        out += [slot(a + "kv_a_proj_with_mqa.bias", (Rkv + Dr,), b + "kv_a.bias"),
                slot(a + "o_proj.bias", (D,), b + "out.bias")]
    return out


def moe_extra_slots(cfg: ModelConfig, hf: str, dl: str, slot: Callable[..., Any]) -> list[Any]:
    """The correction bias and the shared experts of one MoE layer."""
    D, E, Fs = cfg.d_model, cfg.moe.num_experts, cfg.moe.shared_width
    s = hf + "mlp.shared_experts."
    return [slot(hf + "mlp.gate.e_score_correction_bias", (E,), dl + "ffn.router.expert_bias"),
            slot(s + "gate_proj.weight", (Fs, D), dl + "ffn.shared.gate_up.weight", (slice(0, Fs),)),
            slot(s + "up_proj.weight", (Fs, D), dl + "ffn.shared.gate_up.weight", (slice(Fs, 2 * Fs),)),
            slot(s + "down_proj.weight", (D, Fs), dl + "ffn.shared.down.weight")]
