"""Hugging Face <-> dropless for Qwen3-MoE, Mixtral and DeepSeek-V3: the config translation and the
tensor map (DeepSeek-V3's own parts: hf/deepseek.py).

Legend: E experts, D model width, F hidden width of one expert (or of the dense MLP), Hq query heads,
Hkv key/value heads, Dh head width, V vocabulary.

One table serves both directions. `slots(cfg, family)` lists every tensor of the HF checkpoint as a
`Slot`: its HF name and shape, the dropless parameter it lives in, the region of that parameter
(`index`) and whether the HF tensor is that region transposed. Import copies each HF tensor into its
region; export reads each region back out. The round trip is therefore the identity by construction,
and a test checks it against transformers' own files.

The layouts (what transformers 4.x and 5.x `save_pretrained` write; 5.x fuses the experts in memory
and converts back on save):

    HF (per layer i)                                      dropless (blocks.i.)
    self_attn.q_proj / k_proj / v_proj .weight (.bias)    attn.qkv.weight (.bias) rows [q | k | v]
    self_attn.o_proj.weight (.bias)                       attn.out.weight (.bias)
    self_attn.q_norm / k_norm .weight        (Qwen3)      attn.q_norm / k_norm .weight
    input_layernorm / post_attention_layernorm .weight    attn_norm / ffn_norm .weight
    mlp.gate_proj / up_proj / down_proj      (dense)      ffn.gate_up.weight rows [gate | up], ffn.down
    mlp.gate.weight                          (Qwen3)      ffn.router.weight          [E, D]
    mlp.experts.{e}.gate_proj / up_proj      (Qwen3)      ffn.experts.w_gate_up_EDF[e] columns [gate | up]
    mlp.experts.{e}.down_proj                (Qwen3)      ffn.experts.w_down_EFD[e]  (transposed)
    block_sparse_moe.gate.weight             (Mixtral)    ffn.router.weight
    block_sparse_moe.experts.{e}.w1 / w3 / w2 (Mixtral)   gate / up / down, as for Qwen3
    model.embed_tokens, model.norm, lm_head               embed, norm, head (no lm_head when tied)

Import also reads the fused layout transformers 5.x keeps in memory (`mlp.experts.gate_up_proj`
[E, 2F, D], `mlp.experts.down_proj` [E, D, F], and Mixtral's router as `mlp.gate.weight`), in case a
checkpoint was written that way (`fused_slots`).

Routing. Both families take softmax over all E router logits, then the top k; Mixtral always
renormalises the k weights to sum to 1, Qwen3-MoE when `norm_topk_prob`. dropless: score_func
"softmax", pre_softmax, renormalize = that flag (with k = 1 a renormalised weight is 1: norm_top_k = 1
says so, since dropless's renormalize leaves a single weight alone).

Balancing. Neither family balances unless `output_router_logits` is set (a fine-tune that forgets it
trains with no balancing at all); dropless keeps the aux loss on. transformers' rule: one Switch loss
over the tokens of all MoE layers together, f_e summed over the k choices (it reads k at balance),
times `router_aux_loss_coef`. dropless's aux loss is per layer and reads 1 at balance, summed over
layers, so `aux_loss_coeff = router_aux_loss_coef * k / n_moe_layers` gives the same total at balance,
and exactly the same loss with one MoE layer (tests/test_hf_parity.py). No z-loss (neither family has
one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..moe_config import BalanceConfig, MoEConfig, RouterConfig
from . import deepseek

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}
_MISSING = object()


@dataclass(frozen=True)
class Slot:
    hf_name: str
    shape: tuple[int, ...]  # the HF tensor's shape
    param: str  # dropless parameter or buffer name (as in model.state_dict())
    index: tuple[Any, ...] = ()  # the region of the parameter (empty: all of it)
    transpose: bool = False  # the HF tensor is the region with its last two dims swapped


def _refuse(field: str, value: Any, why: str) -> None:
    raise ValueError(f"config.json {field}={value!r}: {why}")


def _field(hf: dict[str, Any], name: str, default: Any = _MISSING) -> Any:
    if name in hf and hf[name] is not None:
        return hf[name]
    if default is _MISSING:
        _refuse(name, None, "missing (a field this family's config always has)")
    return default


def rope_theta(hf: dict[str, Any]) -> float:
    """The rotary base from `rope_parameters` (transformers 5) or `rope_theta` (4.x); only the plain
    rotary ("default" type) is expressible: scaled variants (yarn, linear, dynamic...) are refused."""
    params = hf.get("rope_parameters")
    if params is not None:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            _refuse("rope_parameters.rope_type", kind, "only the plain rotary ('default') is supported")
        return float(params["rope_theta"])
    if hf.get("rope_scaling") is not None:
        _refuse("rope_scaling", hf["rope_scaling"], "rotary scaling is not supported (plain rotary only)")
    return float(_field(hf, "rope_theta", 1e6 if hf.get("model_type") == "mixtral" else 10000.0))


def _dense_layers(hf: dict[str, Any], n_layers: int, num_experts: int) -> int:
    """Qwen3-MoE's rule for which layers are dense, as dropless's `n_dense_layers` (a prefix)."""
    mlp_only = list(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    moe = [i for i in range(n_layers) if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0]
    dense = [i for i in range(n_layers) if i not in moe]
    if not moe:
        _refuse("num_experts", num_experts, "no MoE layer: a dense model (dropless imports MoE models)")
    if dense != list(range(len(dense))):
        field, value = ("decoder_sparse_step", step) if step != 1 else ("mlp_only_layers", mlp_only)
        _refuse(field, value, f"dense layers {dense} are not the first ones; dropless puts dense layers "
                "first (model.n_dense_layers), then MoE layers")
    return len(dense)


def model_config(hf: dict[str, Any]) -> tuple[ModelConfig, str]:
    """A dropless ModelConfig equal to an HF config.json (as a dict), and its family; a ValueError
    naming the HF field for anything dropless cannot express."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        _refuse("model_type", family, f"supported families: {', '.join(FAMILIES)}")
    if _field(hf, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf["hidden_act"], "only silu (SwiGLU experts) is supported")
    if float(hf.get("attention_dropout", 0.0) or 0.0) != 0.0:
        _refuse("attention_dropout", hf["attention_dropout"], "dropless has no attention dropout")
    if family == "deepseek_v3":
        return deepseek.model_config(hf, _field, _refuse, rope_theta), family
    d, n_layers, H = _field(hf, "hidden_size"), _field(hf, "num_hidden_layers"), _field(hf, "num_attention_heads")
    max_pos = _field(hf, "max_position_embeddings")
    if family == "qwen3_moe":
        if hf.get("use_sliding_window"):
            _refuse("use_sliding_window", True, "sliding-window attention is not supported")
        E, d_expert = _field(hf, "num_experts", _field(hf, "num_local_experts", 0)), _field(hf, "moe_intermediate_size")
        n_dense = _dense_layers(hf, n_layers, E)
        renorm, qk_norm, bias = bool(hf.get("norm_topk_prob", False)), True, bool(hf.get("attention_bias", False))
        d_ff_dense = int(hf.get("intermediate_size") or 1)  # read only by dense layers
    else:
        window = hf.get("sliding_window")
        if window is not None and window < max_pos:
            _refuse("sliding_window", window, f"below max_position_embeddings={max_pos}: sliding-window "
                    "attention is not supported")
        if float(hf.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
            _refuse("router_jitter_noise", hf["router_jitter_noise"], "router jitter is not supported")
        E, d_expert = _field(hf, "num_local_experts"), _field(hf, "intermediate_size")
        n_dense, renorm, qk_norm, bias, d_ff_dense = 0, True, False, False, 512
    K = _field(hf, "num_experts_per_tok")
    router = RouterConfig(score_func="softmax", pre_softmax=True, renormalize=renorm,
                          norm_top_k=1 if (K == 1 and renorm) else None)
    aux = float(hf.get("router_aux_loss_coef", 0.001)) * K / (n_layers - n_dense)
    moe = MoEConfig(num_experts=E, top_k=K, d_expert=d_expert, activation="swiglu", router=router,
                    balance=BalanceConfig(aux_loss_coeff=aux, z_loss_coeff=0.0))
    cfg = ModelConfig(
        vocab_size=_field(hf, "vocab_size"), d_model=d, n_layers=n_layers, n_heads=H,
        n_kv_heads=_field(hf, "num_key_value_heads", H), head_dim=_field(hf, "head_dim", d // H),
        qk_norm=qk_norm, attn_bias=bias, max_seq_len=max_pos, n_dense_layers=n_dense, d_ff_dense=d_ff_dense,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_theta=rope_theta(hf),
        norm_eps=float(_field(hf, "rms_norm_eps")), init_std=float(hf.get("initializer_range", 0.02)), moe=moe)
    return cfg, family


def _fail(field: str, value: Any, family: str, why: str) -> None:
    raise ValueError(f"{field}={value!r}: {family} cannot express it ({why})")


def renormalises(cfg: ModelConfig) -> bool:
    """Whether the k routing weights are rescaled to sum to 1 (module note: k = 1 needs norm_top_k)."""
    r = cfg.moe.router
    return r.norm_top_k is not None or (r.renormalize and cfg.moe.top_k > 1)


def check_exportable(cfg: ModelConfig, family: str) -> None:
    """A ValueError naming the dropless field for anything the HF family cannot express."""
    if family not in FAMILIES:
        raise ValueError(f"--family {family!r}: choose one of {', '.join(FAMILIES)}")
    m, r = cfg.moe, cfg.moe.router
    checks = [
        ("model.moe.activation", m.activation, m.activation != "swiglu", "SwiGLU experts only"),
        ("model.moe.act_clamp", m.act_clamp, m.act_clamp is not None, "no activation clamp"),
        ("model.moe.act_softcap", m.act_softcap, m.act_softcap is not None, "no activation softcap"),
        ("model.moe.capacity_factor", m.capacity_factor, m.capacity_factor is not None,
         "dropless routing only: no capacity drops"),
        ("model.moe.router.strategy", r.strategy, r.strategy != "token_choice", "token-choice top-k only"),
        ("model.moe.router.norm_top_k", r.norm_top_k,
         r.norm_top_k is not None and r.norm_top_k != m.top_k, "weights normalised over the top_k run"),
        ("model.n_dense_layers", cfg.n_dense_layers, cfg.n_moe_layers == 0, "no MoE layer"),
        ("model.moe_layer_freq", cfg.moe_layer_freq,
         cfg.moe_layer_ids != tuple(range(cfg.n_dense_layers, cfg.n_layers)), "a dense prefix, then MoE layers"),
        ("model.block", cfg.block, cfg.block != "sequential", "sequential blocks"),
        ("model.moe.n_identity_experts", m.n_identity_experts, m.n_identity_experts > 0, "no identity experts"),
        ("model.moe.latent_dim", m.latent_dim, m.latent_dim > 0, "experts in the model width"),
        ("model.qk_norm", cfg.qk_norm, cfg.qk_norm and family != "qwen3_moe", "no q/k RMSNorm"),
        ("model.rope_yarn.factor", cfg.rope_yarn.factor, cfg.rope_yarn.factor != 1.0 and family != "deepseek_v3",
         "plain rotary only here (yarn: deepseek_v3)"),
    ]
    if family == "deepseek_v3":
        checks += deepseek.checks(cfg)
    else:
        checks += [
            ("model.attention", cfg.attention, cfg.attention != "standard", "multi-head / grouped-query only"),
            ("model.moe.n_shared_experts", m.n_shared_experts, m.n_shared_experts > 0, "no shared experts"),
            ("model.moe.router.score_func", r.score_func, r.score_func != "softmax", "softmax router scores only"),
            ("model.moe.router.pre_softmax", r.pre_softmax, not r.pre_softmax, "softmax over all experts, then top-k"),
            ("model.moe.router.scaling_factor", r.scaling_factor, r.scaling_factor != 1.0, "no routing scale"),
            ("model.moe.router.n_groups", r.n_groups, r.n_groups != 1, "no group-limited routing"),
            ("model.moe.router.use_expert_bias", r.use_expert_bias, r.use_expert_bias, "no expert bias"),
        ]
    if family == "mixtral":
        checks += [
            ("model.attn_bias", cfg.attn_bias, cfg.attn_bias, "no attention biases"),
            ("model.n_dense_layers", cfg.n_dense_layers, cfg.n_dense_layers > 0, "every layer is MoE"),
            ("model.moe.router.renormalize", r.renormalize, not renormalises(cfg),
             "the top-k weights are always renormalised (with top_k=1: set norm_top_k=1)"),
        ]
    elif family == "qwen3_moe":
        checks.append(("model.qk_norm", cfg.qk_norm, not cfg.qk_norm, "Qwen3 always normalises q and k"))
    for field, value, bad, why in checks:
        if bad:
            _fail(field, value, family, why)


def hf_config(cfg: ModelConfig, family: str, dtype: str = "float32") -> dict[str, Any]:
    """The config.json of `cfg` as an HF `family` model (check_exportable first)."""
    check_exportable(cfg, family)
    m = cfg.moe
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]], "model_type": family, "dtype": dtype,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_dropout": 0.0, "num_experts_per_tok": m.top_k, "output_router_logits": False,
        "router_aux_loss_coef": m.balance.aux_loss_coeff * cfg.n_moe_layers / m.top_k, "use_cache": True,
        # unknown here (export fills them from the tokenizer's generation_config.json); explicit, so
        # that no family default (Mixtral: bos 1, eos 2) is taken for this tokenizer's ids
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    if family != "deepseek_v3":
        out["head_dim"] = cfg.head_width  # (DeepSeek-V3's config derives it: qk_rope_head_dim)
    if family == "deepseek_v3":
        out.update(deepseek.hf_config(cfg))
        out["norm_topk_prob"] = renormalises(cfg)
        del out["router_aux_loss_coef"]  # (the family has no aux loss field; its rule: hf/deepseek.py)
    elif family == "qwen3_moe":
        out.update({"num_experts": m.num_experts, "moe_intermediate_size": m.d_expert,
                    "norm_topk_prob": renormalises(cfg), "decoder_sparse_step": 1,
                    "mlp_only_layers": list(range(cfg.n_dense_layers)), "intermediate_size": cfg.d_ff_dense,
                    "attention_bias": cfg.attn_bias, "use_sliding_window": False, "sliding_window": None})
    else:
        out.update({"num_local_experts": m.num_experts, "intermediate_size": m.d_expert,
                    "sliding_window": None, "router_jitter_noise": 0.0})
    return out


def _moe_prefix(family: str, i: int) -> str:
    return f"model.layers.{i}." + ("block_sparse_moe" if family == "mixtral" else "mlp")


def _expert_names(family: str) -> tuple[str, str, str]:
    return ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def slots(cfg: ModelConfig, family: str) -> list[Slot]:
    """Every tensor of the HF checkpoint (the per-expert layout save_pretrained writes), in the
    module note's map."""
    D, V = cfg.d_model, cfg.vocab_size
    out = [Slot("model.embed_tokens.weight", (V, D), "embed.weight"), Slot("model.norm.weight", (D,), "norm.weight")]
    if not cfg.tie_embeddings:
        out.append(Slot("lm_head.weight", (V, D), "head.weight"))
    for i in range(cfg.n_layers):
        hf, dl = f"model.layers.{i}.", f"blocks.{i}."
        out += [Slot(hf + "input_layernorm.weight", (D,), dl + "attn_norm.weight"),
                Slot(hf + "post_attention_layernorm.weight", (D,), dl + "ffn_norm.weight")]
        if cfg.attention == "mla":
            out += deepseek.attention_slots(cfg, hf, dl, Slot)
        else:
            out += _attention_slots(cfg, hf, dl)
        if i < cfg.n_dense_layers:  # Qwen3's or DeepSeek's dense MLP (check_exportable keeps Mixtral all-MoE)
            F = cfg.d_ff_dense
            out += [Slot(hf + "mlp.gate_proj.weight", (F, D), dl + "ffn.gate_up.weight", (slice(0, F),)),
                    Slot(hf + "mlp.up_proj.weight", (F, D), dl + "ffn.gate_up.weight", (slice(F, 2 * F),)),
                    Slot(hf + "mlp.down_proj.weight", (D, F), dl + "ffn.down.weight")]
            continue
        p, E, F = _moe_prefix(family, i), cfg.moe.num_experts, cfg.moe.d_expert
        gate, up, down = _expert_names(family)
        w1, w2 = dl + "ffn.experts.w_gate_up_EDF", dl + "ffn.experts.w_down_EFD"
        out.append(Slot(p + ".gate.weight", (E, D), dl + "ffn.router.weight"))
        if family == "deepseek_v3":
            out += deepseek.moe_extra_slots(cfg, hf, dl, Slot)
        for e in range(E):
            x = f"{p}.experts.{e}."
            out += [Slot(x + gate + ".weight", (F, D), w1, (e, slice(None), slice(0, F)), True),
                    Slot(x + up + ".weight", (F, D), w1, (e, slice(None), slice(F, 2 * F)), True),
                    Slot(x + down + ".weight", (D, F), w2, (e,), True)]
    return out


def _attention_slots(cfg: ModelConfig, hf: str, dl: str) -> list[Slot]:
    """One layer's multi-head / grouped-query attention (the module note's first rows)."""
    D, Dh = cfg.d_model, cfg.head_width
    Hq, Hkv = cfg.n_heads * Dh, cfg.kv_heads * Dh  # rows of the q and of the k (or v) projection
    a, qkv = hf + "self_attn.", dl + "attn.qkv."
    out = [Slot(a + "o_proj.weight", (D, Hq), dl + "attn.out.weight")]
    rows = {"q_proj": slice(0, Hq), "k_proj": slice(Hq, Hq + Hkv), "v_proj": slice(Hq + Hkv, Hq + 2 * Hkv)}
    for name, r in rows.items():
        out.append(Slot(f"{a}{name}.weight", (r.stop - r.start, D), qkv + "weight", (r,)))
        if cfg.attn_bias:
            out.append(Slot(f"{a}{name}.bias", (r.stop - r.start,), qkv + "bias", (r,)))
    if cfg.attn_bias:
        out.append(Slot(a + "o_proj.bias", (D,), dl + "attn.out.bias"))
    if cfg.qk_norm:
        out += [Slot(a + "q_norm.weight", (Dh,), dl + "attn.q_norm.weight"),
                Slot(a + "k_norm.weight", (Dh,), dl + "attn.k_norm.weight")]
    return out


def fused_slots(cfg: ModelConfig, family: str) -> list[Slot]:
    """The experts in transformers 5's fused in-memory layout (import only; module note)."""
    out = []
    E, D, F = cfg.moe.num_experts, cfg.d_model, cfg.moe.d_expert
    for i in range(cfg.n_dense_layers, cfg.n_layers):
        hf, dl = f"model.layers.{i}.mlp.", f"blocks.{i}.ffn."
        out += [Slot(hf + "experts.gate_up_proj", (E, 2 * F, D), dl + "experts.w_gate_up_EDF", (), True),
                Slot(hf + "experts.down_proj", (E, D, F), dl + "experts.w_down_EFD", (), True)]
        if family == "mixtral":
            out.append(Slot(hf + "gate.weight", (E, D), dl + "router.weight"))
    return out
