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
    HF (MTP layer k: model.layers.{num_hidden_layers + k}.)  dropless (mtp.k., layers/mtp.py)
    enorm.weight / hnorm.weight  [D]             embed_norm.weight / hidden_norm.weight
    eh_proj.weight               [D, 2D]         proj.weight  (columns [embedding | hidden], as is)
    shared_head.norm.weight      [D]             out_norm.weight
    input_layernorm, post_attention_layernorm, self_attn.*, mlp.*   block.* (a main layer's map)
    embed_tokens.weight, shared_head.head.weight  copies of model.embed_tokens / lm_head (below)

Multi-token prediction. DeepSeek's checkpoint stores MTP layer k after the main layers; dropless
holds it as MTP module k with an MoE block (model.mtp_block "moe"; layers/mtp.py computes
h = block(eh_proj([enorm(embed(token t+k)); hnorm(h_prev)])), logits = head(shared_head.norm(h)),
the embedding and head shared). `embed_tokens` and `shared_head.head` of an MTP layer repeat the
main embedding and head: import checks each equals the main tensor exactly (a ValueError naming it
otherwise) and stores nothing; export writes the main ones again. transformers writes
`num_nextn_predict_layers` (its default 1) on every save but never builds nor saves the layers, so
the key alone does not say a checkpoint holds them: import counts the layers whose tensors the
checkpoint has (all of them, or none: then the model has no MTP modules; some of them is refused).
Export (mtp_block "moe") writes them and num_nextn_predict_layers = mtp_depth; a dense-block MTP
is left out and 0 written. transformers ignores the layers on load only as `model.layers.61.*`
(`_keys_to_ignore_on_load_unexpected`, DeepSeek-V3's 61 layers): another depth reports them as
unexpected keys, and computes the main model all the same.

Which layers are MoE. DeepSeek's reference code: layer i is MoE iff i >= first_k_dense_replace and
i % moe_layer_freq == 0. transformers 5 ignores moe_layer_freq (MoE iff i >= first_k_dense_replace).
Import follows DeepSeek's rule, which is what its checkpoints hold (moe_layer_freq 1: exactly
transformers' model; else dropless's list of MoE layers, model.moe_layer_freq, and transformers
would not load such a checkpoint without missing keys). Export writes the pair that gives
dropless's layers under DeepSeek's rule (moe_layer_freq 1 whenever the MoE layers are all those
after a dense prefix, so transformers builds the same model); a pattern the rule cannot give is
refused by name.

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
`attention_factor` / `partial_rotary_factor` / `truncate: false` (hf/rope.py), num_key_value_heads != num_attention_heads (transformers' MLA would not
run either), n_shared_experts = 0, a scoring function other than sigmoid, a topk_method other than
"noaux_tc", groups of fewer than two experts.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ..config import ModelConfig
from ..model_knobs import moe_layout
from ..moe_config import BalanceConfig, MoEConfig, RouterConfig
from . import rope
from .defaults import Fields, refuse

BIAS_UPDATE_RATE = 1e-3
SEQ_AUX_LOSS_COEFF = 1e-4


def mtp_depth(f: Fields, names: Iterable[str] | None) -> int:
    """How many MTP layers the checkpoint holds (module note): num_nextn_predict_layers when
    `names` (its tensor names) has every one of them, 0 when it has none (or `names` is None)."""
    n_layers, declared = f("num_hidden_layers"), int(f("num_nextn_predict_layers") or 0)
    held = set()
    for name in names or ():
        parts = name.split(".")
        if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= n_layers:
            held.add(int(parts[2]))
    if held and held != set(range(n_layers, n_layers + declared)):
        refuse("num_nextn_predict_layers", declared, f"the checkpoint holds layers {sorted(held)} after its "
               f"num_hidden_layers={n_layers}, expected {list(range(n_layers, n_layers + declared))} (or none)")
    return declared if held else 0


def model_config(f: Fields, names: Iterable[str] | None = None) -> ModelConfig:
    """The dropless config of a DeepSeek-V3 config.json (read through `f`: transformers' defaults);
    `names`: the checkpoint's tensor names, for its MTP layers (module note)."""
    n_layers, H = f("num_hidden_layers"), f("num_attention_heads")
    kv = f("num_key_value_heads")
    if kv is not None and kv != H:
        refuse("num_key_value_heads", kv, f"MLA has one key/value head per query head (num_attention_heads={H})")
    freq = int(f("moe_layer_freq"))
    if freq < 1:
        refuse("moe_layer_freq", freq, "must be a positive integer")
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
    first_k = f("first_k_dense_replace")
    moe_ids = [i for i in range(n_layers) if i >= first_k and i % freq == 0]  # DeepSeek's rule
    if not moe_ids:
        refuse("first_k_dense_replace", first_k, f"no MoE layer (with moe_layer_freq={freq}): a dense model "
               "(dropless imports MoE models)")
    n_dense, layer_freq = moe_layout(n_layers, moe_ids)
    depth = mtp_depth(f, names)
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
        max_seq_len=f("max_position_embeddings"), n_dense_layers=n_dense, moe_layer_freq=layer_freq,
        mtp_depth=depth, mtp_block="moe" if depth else "dense", d_ff_dense=f("intermediate_size"),
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
        ("model.moe_layer_freq", cfg.moe_layer_freq, layer_rule(cfg.n_layers, list(cfg.moe_layer_ids)) is None,
         "MoE layers i >= first_k_dense_replace with i % moe_layer_freq == 0"),
    ]


def layer_rule(n_layers: int, moe: list[int]) -> tuple[int, int] | None:
    """(first_k_dense_replace, moe_layer_freq) giving the MoE layers `moe` under DeepSeek's rule
    (module note), the smallest freq first (1 whenever possible); None when no pair does."""
    if not moe:
        return None
    for freq in range(1, n_layers + 1):
        if [i for i in range(moe[0], n_layers) if i % freq == 0] == moe:
            return moe[0], freq
    return None


def hf_config(attn: torch.nn.Module, moe: torch.nn.Module, is_moe: list[bool], d_ff_dense: int,
              n_mtp: int) -> dict[str, Any]:
    """DeepSeek-V3's own fields of the config.json, read from the built modules (an MLA block's
    `attn`, an MoE layer `moe`, which blocks are MoE, the MTP modules with MoE blocks);
    mapping.hf_config adds the common ones. `moe_layer_freq` is DeepSeek's key, which transformers
    ignores (module note: 1 unless the layers need another)."""
    r = moe.cfg.router
    E, F, _ = moe.experts.w_down_EFD.shape
    q_a = getattr(attn, "q_a", None)
    rule = layer_rule(len(is_moe), [i for i, m in enumerate(is_moe) if m])
    assert rule is not None  # (checks() refused it)
    first_k, freq = rule
    return {"n_routed_experts": E, "moe_intermediate_size": F,
            "n_shared_experts": moe.shared.down.weight.shape[1] // F, "first_k_dense_replace": first_k,
            "moe_layer_freq": freq,
            "intermediate_size": d_ff_dense, "routed_scaling_factor": r.scaling_factor,
            "n_group": r.n_groups, "topk_group": r.topk_groups,
            "q_lora_rank": q_a.out_features if q_a is not None else None, "kv_lora_rank": attn.kv_rank,
            "qk_rope_head_dim": attn.rope_dim, "qk_nope_head_dim": attn.nope_dim, "v_head_dim": attn.v_dim,
            "rope_interleave": attn.interleave, "attention_bias": attn.out.bias is not None,
            "num_nextn_predict_layers": n_mtp}


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


def mtp_slots(model: torch.nn.Module, slot: Callable[..., Any],
              layer_slots: Callable[[torch.nn.Module, str, str], list[Any]]) -> list[Any]:
    """The MTP layers (module note's table): `layer_slots(block, hf, dl)` is mapping's map of one
    decoder layer; the embedding and head copies are `copy` slots of the main parameters."""
    head = "head.weight" if "head.weight" in slot else "embed.weight"  # (tied: one parameter)
    out = []
    for k, module in enumerate(model.mtp):
        hf, dl = f"model.layers.{len(model.blocks) + k}.", f"mtp.{k}."
        out += [slot(hf + "enorm.weight", dl + "embed_norm.weight"), slot(hf + "hnorm.weight", dl + "hidden_norm.weight"),
                slot(hf + "eh_proj.weight", dl + "proj.weight"),
                slot(hf + "shared_head.norm.weight", dl + "out_norm.weight"),
                slot(hf + "embed_tokens.weight", "embed.weight", copy=True),
                slot(hf + "shared_head.head.weight", head, copy=True)]
        out += layer_slots(module.block, hf, dl + "block.")
    return out
