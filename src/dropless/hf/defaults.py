"""What a config.json means where it is silent: transformers' own defaults, per family.

transformers builds a model from config.json by passing its keys to the family's config class, so a
key the file omits takes the class's default: a DeepSeek-V3 config.json without `n_group` is routed
in 8 groups (DeepseekV3Config), not in one; a Mixtral one without `num_key_value_heads` has 8
key/value heads, not one per query head. The importers read the same model: every key they read
comes through `Fields`, which falls back on this table, written from the config classes of
transformers 4.57 and 5.x (they agree on every key here) and checked against the installed class by
tests/test_hf_defaults.py (`transformers_default`).

`None` in the table is transformers' "derived" value: head_dim = hidden_size // num_attention_heads,
num_key_value_heads = num_attention_heads, q_lora_rank none (a full-rank query projection),
mlp_only_layers none. Where a file writes `null` for such a key it means the same (and for a flag,
false); a `null` for any other key is refused by name (transformers would keep the null and fail, or compute something else).

DeepSeek's own config.json has three keys transformers does not read (`moe_layer_freq`,
`scoring_func`, `topk_method`): transformers computes the same model whatever they say, so their
"default" is what it computes, and the importer refuses values that claim another model.
"""

from __future__ import annotations

from typing import Any

from ..configtree import _fail

_COMMON = {"hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False,
           "attention_dropout": 0.0, "rope_scaling": None, "rope_parameters": None}

DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {**_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None,
                  "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "attention_bias": False, "use_sliding_window": False, "decoder_sparse_step": 1,
                  "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
                  "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": None},
    "mixtral": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None,
                "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8,
                "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0},
    "deepseek_v3": {**_COMMON, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                    "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": 1},
    # the dense families `dropless upcycle` reads
    "qwen3": {**_COMMON, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "attention_bias": False, "use_sliding_window": False},
    "llama": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "attention_bias": False, "mlp_bias": False},
}

# keys of DeepSeek's own config.json that transformers does not read (module note)
UNREAD: dict[str, dict[str, Any]] = {"deepseek_v3": {"moe_layer_freq": 1, "scoring_func": "sigmoid",
                                                     "topk_method": "noaux_tc"}}

# another name a family's config.json may use for the key (transformers 5 writes Qwen3-MoE's
# `num_experts` as `num_local_experts`; DeepSeek-V3 accepts `num_local_experts` too)
ALIASES: dict[str, dict[str, str]] = {"qwen3_moe": {"num_experts": "num_local_experts"},
                                      "deepseek_v3": {"n_routed_experts": "num_local_experts"}}

# keys whose null transformers reads as something: the derived value (module note), or for a flag, false
NULLABLE = frozenset({"head_dim", "num_key_value_heads", "q_lora_rank", "mlp_only_layers", "sliding_window",
                      "rope_scaling", "rope_parameters", "norm_topk_prob", "attention_bias", "rope_interleave",
                      "tie_word_embeddings", "use_sliding_window", "mlp_bias"})


def refuse(field: str, value: Any, why: str) -> None:
    """configtree's "field=value: why" ValueError for a key of config.json."""
    _fail(f"config.json {field}", value, why)


class Fields:
    """A config.json (as a dict) read as transformers reads it: a key it omits is the family's
    default. `fields("n_group")`; only keys of the table (or UNREAD) can be read."""

    def __init__(self, hf: dict[str, Any], family: str) -> None:
        self.hf, self.family = hf, family
        self.defaults = {**DEFAULTS[family], **UNREAD.get(family, {})}

    def __contains__(self, name: str) -> bool:
        """Whether the file itself sets `name` (or its alias)."""
        return self._key(name) is not None

    def _key(self, name: str) -> str | None:
        alias = ALIASES.get(self.family, {}).get(name)
        given = [k for k in (name, alias) if k is not None and k in self.hf]
        if len(given) == 2 and self.hf[name] != self.hf[alias]:
            refuse(name, self.hf[name], f"disagrees with {alias}={self.hf[alias]!r} (the same field)")
        return given[0] if given else None

    def __call__(self, name: str) -> Any:
        if name not in self.defaults:
            raise KeyError(f"{name}: not in hf/defaults.py's table for {self.family}")
        key = self._key(name)
        if key is None:
            return self.defaults[name]
        value = self.hf[key]
        if value is None and name not in NULLABLE:
            refuse(key, None, f"null (transformers' {self.family} default is {self.defaults[name]!r}; "
                   "omit the key to mean it)")
        return value
