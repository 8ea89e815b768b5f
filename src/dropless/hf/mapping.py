"""Hugging Face <-> dropless for Qwen3-MoE, Mixtral and DeepSeek-V3: the config translation and the
tensor map (DeepSeek-V3's own parts: hf/deepseek.py).

Legend: E experts, D model width, F hidden width of one expert (or of the dense MLP), Hq query heads,
Hkv key/value heads, Dh head width, V vocabulary.

One table serves both directions. `slots(model, family)` lists every tensor of the HF checkpoint as a
`Slot`: its HF name and shape, the dropless parameter it lives in, the region of that parameter
(`index`) and whether the HF tensor is that region transposed. Import copies each HF tensor into its
region; export reads each region back out. The round trip through this table alone is the identity
whatever the table says, so the tests check it against transformers itself: its logits on the
original checkpoint, on dropless's import and on the export (tests/test_hf_parity.py).

The built modules are the truth about shapes: every width and count here (heads, head widths, expert
counts and widths, latent ranks, which layers are MoE) is read from the model's modules and
parameters, not derived again from config fields; `hf_config` builds the model on the meta device
for that. A config.json key the file omits means transformers' default (hf/defaults.py); the rotary
is read and written in both transformers 4.x's and 5.x's spelling (hf/rope.py).

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
from typing import Any, Iterable

import torch

from ..config import ModelConfig
from ..configtree import _fail
from ..model import MoEModel
from ..model_knobs import moe_layout
from ..moe_config import BalanceConfig, MoEConfig, RouterConfig
from . import deepseek, rope
from .defaults import Fields, refuse

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclass(frozen=True)
class Slot:
    hf_name: str
    shape: tuple[int, ...]  # the HF tensor's shape
    param: str  # dropless parameter or buffer name (as in model.state_dict())
    index: tuple[Any, ...] = ()  # the region of the parameter (empty: all of it)
    transpose: bool = False  # the HF tensor is the region with its last two dims swapped
    # the HF tensor is a second copy of the whole parameter, which another slot fills (DeepSeek-V3's
    # MTP layers repeat the embedding and the head): import checks it equals that parameter and
    # stores nothing; export writes the parameter again
    copy: bool = False


def _qwen3_layers(n_layers: int, num_experts: int, mlp_only: list[int], step: int) -> list[int]:
    """Qwen3-MoE's rule: layer i is MoE iff i is not in mlp_only_layers and (i + 1) % step == 0."""
    moe = [i for i in range(n_layers) if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0]
    if not moe:
        refuse("num_experts", num_experts, "no MoE layer: a dense model (dropless imports MoE models)")
    return moe


def model_config(hf: dict[str, Any], names: Iterable[str] | None = None) -> tuple[ModelConfig, str]:
    """A dropless ModelConfig equal to an HF config.json (as a dict), and its family; a key the file
    omits is transformers' default (hf/defaults.py); a ValueError naming the HF field for anything
    dropless cannot express. `names`: the checkpoint's tensor names, where it matters which are
    there (DeepSeek-V3's multi-token-prediction layers, hf/deepseek.py); None: the config alone."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        refuse("model_type", family, f"supported families: {', '.join(FAMILIES)}")
    f = Fields(hf, family)
    if f("hidden_act") != "silu":
        refuse("hidden_act", f("hidden_act"), "only silu (SwiGLU experts) is supported")
    if float(f("attention_dropout")) != 0.0:
        refuse("attention_dropout", f("attention_dropout"), "dropless has no attention dropout")
    if family == "deepseek_v3":
        return deepseek.model_config(f, names), family
    d, n_layers, H, max_pos = f("hidden_size"), f("num_hidden_layers"), f("num_attention_heads"), f("max_position_embeddings")
    if family == "qwen3_moe":
        if f("use_sliding_window"):
            refuse("use_sliding_window", True, "sliding-window attention is not supported")
        E, d_expert = f("num_experts"), f("moe_intermediate_size")
        moe_ids = _qwen3_layers(n_layers, E, list(f("mlp_only_layers") or []), int(f("decoder_sparse_step")))
        renorm, qk_norm, bias = bool(f("norm_topk_prob")), True, bool(f("attention_bias"))
        d_ff_dense = f("intermediate_size")  # read only by dense layers
    else:
        window = f("sliding_window")
        if window is not None and window < max_pos:
            refuse("sliding_window", window, f"below max_position_embeddings={max_pos}: sliding-window "
                   "attention is not supported")
        if float(f("router_jitter_noise")) != 0.0:
            refuse("router_jitter_noise", f("router_jitter_noise"), "router jitter is not supported")
        E, d_expert = f("num_local_experts"), f("intermediate_size")
        moe_ids, renorm, qk_norm, bias, d_ff_dense = list(range(n_layers)), True, False, False, 512
    n_dense, freq = moe_layout(n_layers, moe_ids)
    K = f("num_experts_per_tok")
    router = RouterConfig(score_func="softmax", pre_softmax=True, renormalize=renorm,
                          norm_top_k=1 if (K == 1 and renorm) else None)
    aux = float(f("router_aux_loss_coef")) * K / len(moe_ids)
    moe = MoEConfig(num_experts=E, top_k=K, d_expert=d_expert, activation="swiglu", router=router,
                    balance=BalanceConfig(aux_loss_coeff=aux, z_loss_coeff=0.0))
    kv, head_dim = f("num_key_value_heads"), f("head_dim")
    theta, _ = rope.read(f)
    cfg = ModelConfig(
        vocab_size=f("vocab_size"), d_model=d, n_layers=n_layers, n_heads=H, n_kv_heads=H if kv is None else kv,
        head_dim=head_dim or d // H, qk_norm=qk_norm, attn_bias=bias, max_seq_len=max_pos, n_dense_layers=n_dense,
        moe_layer_freq=freq, d_ff_dense=d_ff_dense, tie_embeddings=bool(f("tie_word_embeddings")), rope_theta=theta,
        norm_eps=float(f("rms_norm_eps")), init_std=float(f("initializer_range")), moe=moe)
    return cfg, family


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
            ("model.moe_layer_freq", cfg.moe_layer_freq, cfg.n_moe_layers != cfg.n_layers, "every layer is MoE"),
            ("model.moe.router.renormalize", r.renormalize, not renormalises(cfg),
             "the top-k weights are always renormalised (with top_k=1: set norm_top_k=1)"),
        ]
    elif family == "qwen3_moe":
        checks.append(("model.qk_norm", cfg.qk_norm, not cfg.qk_norm, "Qwen3 always normalises q and k"))
    for field, value, bad, why in checks:
        if bad:
            _fail(field, value, f"{family} cannot express it ({why})")


def meta_model(cfg: ModelConfig) -> MoEModel:
    """The model of `cfg` on the meta device: its modules and parameter shapes, no storage."""
    with torch.device("meta"):
        return MoEModel(cfg)


def hf_config(cfg: ModelConfig, family: str, dtype: str = "float32") -> dict[str, Any]:
    """The config.json of `cfg` as an HF `family` model (check_exportable first); the widths and
    counts are read from the model's modules (built on the meta device)."""
    check_exportable(cfg, family)
    model = meta_model(cfg)
    V, D = model.embed.weight.shape
    attn, moe = model.blocks[0].attn, model.moe_layers()
    E, F, _ = moe[0].experts.w_down_EFD.shape
    dense = [b.ffn for b in model.blocks if not b.is_moe]
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]], "model_type": family,
        # transformers 5 reads `dtype`; 4.x (the extra allows >=4.51) reads `torch_dtype`, which 5 accepts too
        "dtype": dtype, "torch_dtype": dtype,
        "vocab_size": V, "hidden_size": D, "num_hidden_layers": len(model.blocks),
        "num_attention_heads": attn.n_heads, "num_key_value_heads": getattr(attn, "n_kv_heads", attn.n_heads),
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": model.head.weight is model.embed.weight,
        **rope.hf_keys(cfg), "attention_dropout": 0.0, "num_experts_per_tok": cfg.moe.top_k,
        "output_router_logits": False, "use_cache": True,
        "router_aux_loss_coef": cfg.moe.balance.aux_loss_coeff * len(moe) / cfg.moe.top_k,
        # unknown here (export fills them from the tokenizer's generation_config.json); explicit, so
        # that no family default (Mixtral: bos 1, eos 2) is taken for this tokenizer's ids
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    d_ff_dense = dense[0].down.weight.shape[1] if dense else cfg.d_ff_dense  # (no dense layer: never read)
    if family == "deepseek_v3":
        out.update(deepseek.hf_config(attn, moe[0], [b.is_moe for b in model.blocks], d_ff_dense,
                                      len(model.mtp) if model.mtp_moe_layers() else 0))
        out["norm_topk_prob"] = renormalises(cfg)
        del out["router_aux_loss_coef"]  # (the family has no aux loss field; its rule: hf/deepseek.py)
        return out
    out["head_dim"] = attn.head_dim  # (DeepSeek-V3's config derives it: qk_rope_head_dim)
    if family == "qwen3_moe":
        out.update({"num_experts": E, "moe_intermediate_size": F, "norm_topk_prob": renormalises(cfg),
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [i for i, b in enumerate(model.blocks) if not b.is_moe],
                    "intermediate_size": d_ff_dense, "attention_bias": attn.qkv.bias is not None,
                    "use_sliding_window": False, "sliding_window": None})
    else:
        out.update({"num_local_experts": E, "intermediate_size": F, "sliding_window": None,
                    "router_jitter_noise": 0.0})
    return out


def _moe_prefix(family: str, hf: str) -> str:
    return hf + ("block_sparse_moe" if family == "mixtral" else "mlp")


def _expert_names(family: str) -> tuple[str, str, str]:
    return ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")


class _Slots:
    """Makes the Slots of one model: each shape is the shape of the parameter region it maps to."""

    def __init__(self, model: MoEModel) -> None:
        self.params = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def __contains__(self, param: str) -> bool:
        return param in self.params

    def __call__(self, hf_name: str, param: str, index: tuple[Any, ...] = (), transpose: bool = False,
                 copy: bool = False) -> Slot:
        shape = tuple((self.params[param][index] if index else self.params[param]).shape)
        if transpose:
            shape = (*shape[:-2], shape[-1], shape[-2])
        return Slot(hf_name, shape, param, index, transpose, copy)


def slots(model: MoEModel, family: str) -> list[Slot]:
    """Every tensor of the HF checkpoint (the per-expert layout save_pretrained writes), in the
    module note's map; the shapes are `model`'s (which may live on the meta device)."""
    slot = _Slots(model)
    out = [slot("model.embed_tokens.weight", "embed.weight"), slot("model.norm.weight", "norm.weight")]
    if "head.weight" in slot:  # (tied: named_parameters lists the shared weight once, as embed.weight)
        out.append(slot("lm_head.weight", "head.weight"))
    for i, block in enumerate(model.blocks):
        out += _layer_slots(block, f"model.layers.{i}.", f"blocks.{i}.", family, slot)
    if family == "deepseek_v3" and model.mtp_moe_layers():  # (dense MTP blocks: left out, export_hf.py)
        out += deepseek.mtp_slots(model, slot, lambda block, hf, dl: _layer_slots(block, hf, dl, family, slot))
    return out


def _layer_slots(block: torch.nn.Module, hf: str, dl: str, family: str, slot: _Slots) -> list[Slot]:
    """One decoder layer (`hf`, `dl`: its prefixes; a main block, or an MTP module's)."""
    out = [slot(hf + "input_layernorm.weight", dl + "attn_norm.weight"),
           slot(hf + "post_attention_layernorm.weight", dl + "ffn_norm.weight")]
    if family == "deepseek_v3":
        out += deepseek.attention_slots(hf, dl, slot)
    else:
        out += _attention_slots(block.attn, hf, dl, slot)
    if not block.is_moe:  # Qwen3's or DeepSeek's dense MLP (check_exportable keeps Mixtral all-MoE)
        return out + _mlp_slots(block.ffn, hf + "mlp.", dl + "ffn.", slot)
    p, (gate, up, down) = _moe_prefix(family, hf), _expert_names(family)
    w1, w2 = dl + "ffn.experts.w_gate_up_EDF", dl + "ffn.experts.w_down_EFD"
    E, F, _ = block.ffn.experts.w_down_EFD.shape
    out.append(slot(p + ".gate.weight", dl + "ffn.router.weight"))
    if family == "deepseek_v3":
        out.append(slot(hf + "mlp.gate.e_score_correction_bias", dl + "ffn.router.expert_bias"))
        out += _mlp_slots(block.ffn.shared, hf + "mlp.shared_experts.", dl + "ffn.shared.", slot)
    for e in range(E):
        x = f"{p}.experts.{e}."
        out += [slot(x + gate + ".weight", w1, (e, slice(None), slice(0, F)), True),
                slot(x + up + ".weight", w1, (e, slice(None), slice(F, 2 * F)), True),
                slot(x + down + ".weight", w2, (e,), True)]
    return out


def _mlp_slots(mlp: torch.nn.Module, hf: str, dl: str, slot: _Slots) -> list[Slot]:
    """A SwiGLU MLP (a dense layer's, or DeepSeek's shared experts): gate and up are the two halves
    of the fused gate_up rows."""
    F = mlp.down.weight.shape[1]
    return [slot(hf + "gate_proj.weight", dl + "gate_up.weight", (slice(0, F),)),
            slot(hf + "up_proj.weight", dl + "gate_up.weight", (slice(F, 2 * F),)),
            slot(hf + "down_proj.weight", dl + "down.weight")]


def _attention_slots(attn: torch.nn.Module, hf: str, dl: str, slot: _Slots) -> list[Slot]:
    """One layer's multi-head / grouped-query attention (the module note's first rows)."""
    Hq, Hkv = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim  # rows of q, of k (or v)
    a, qkv = hf + "self_attn.", dl + "attn.qkv."
    out = [slot(a + "o_proj.weight", dl + "attn.out.weight")]
    rows = {"q_proj": slice(0, Hq), "k_proj": slice(Hq, Hq + Hkv), "v_proj": slice(Hq + Hkv, Hq + 2 * Hkv)}
    for name, r in rows.items():
        out.append(slot(f"{a}{name}.weight", qkv + "weight", (r,)))
        if qkv + "bias" in slot:
            out.append(slot(f"{a}{name}.bias", qkv + "bias", (r,)))
    if dl + "attn.out.bias" in slot:
        out.append(slot(a + "o_proj.bias", dl + "attn.out.bias"))
    if dl + "attn.q_norm.weight" in slot:
        out += [slot(a + "q_norm.weight", dl + "attn.q_norm.weight"),
                slot(a + "k_norm.weight", dl + "attn.k_norm.weight")]
    return out


def fused_slots(model: MoEModel, family: str) -> list[Slot]:
    """The experts in transformers 5's fused in-memory layout (import only; module note)."""
    slot, out = _Slots(model), []
    for i, block in enumerate(model.blocks):
        if not block.is_moe:
            continue
        hf, dl = f"model.layers.{i}.mlp.", f"blocks.{i}.ffn."
        out += [slot(hf + "experts.gate_up_proj", dl + "experts.w_gate_up_EDF", (), True),
                slot(hf + "experts.down_proj", dl + "experts.w_down_EFD", (), True)]
        if family == "mixtral":
            out.append(slot(hf + "gate.weight", dl + "router.weight"))
    return out
