"""A key config.json omits means what transformers' config class defaults it to (hf/defaults.py).

Three checks, each against transformers itself rather than against our table: the table equals the
installed config classes' defaults; for every key of each family's config.json, writing
transformers' default out and leaving the key out give the same dropless config (or the same
refusal); and a checkpoint whose config.json leaves out the keys that shape the model (DeepSeek-V3's
groups, scale and dense layers, the key/value heads, the norms' eps) imports as the model transformers
builds from the same file, logits equal.

Tolerance: REFERENCE[fp32], as tests/test_hf_parity.py.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from hf_models import VOCAB, save_hf, transformers
from test_hf_parity import tokens
from test_hf_upcycle import llama_dense, qwen3_dense
from tolerances import REFERENCE, assert_close

from dropless.hf import defaults, import_hf, mapping, upcycle

ABSENT = object()


def transformers_default(family: str, key: str) -> Any:
    """The installed config class's default for `key` (its __init__ argument, or the class's
    `default_theta` for the rotary base in 5.x), ABSENT when the class does not take the key."""
    cls = transformers.CONFIG_MAPPING[family]
    params = inspect.signature(cls.__init__).parameters
    key = key if key in params else {v: k for k, v in getattr(cls, "attribute_map", {}).items()}.get(key, key)
    if key in params:
        return params[key].default
    if key == "rope_theta":
        return cls.default_theta
    return ABSENT


@pytest.mark.parametrize("family", defaults.DEFAULTS)
def test_defaults_table_is_transformers_own(family: str) -> None:
    """Every default of the table is the installed class's; a key the class does not take (read by
    the modeling code with a derived fallback, such as Qwen3-MoE's head_dim) is None in the table."""
    for key, ours in defaults.DEFAULTS[family].items():
        theirs = transformers_default(family, key)
        assert ours == (None if theirs is ABSENT else theirs), f"{family}.{key}: ours {ours!r}, transformers {theirs!r}"


def importer(family: str) -> Callable[[dict[str, Any]], Any]:
    if family in mapping.FAMILIES:
        return lambda hf: mapping.model_config(hf)[0]
    return lambda hf: upcycle.dense_config(hf, experts=4, top_k=2)


TINY = {"qwen3_moe": lambda: transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                          num_attention_heads=4, moe_intermediate_size=8),
        "mixtral": lambda: transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=8, intermediate_size=8),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
                                                             num_attention_heads=4, num_key_value_heads=4,
                                                             n_routed_experts=16, moe_intermediate_size=8),
        "qwen3": lambda: qwen3_dense(), "llama": lambda: llama_dense()}


@pytest.mark.parametrize("family", defaults.DEFAULTS)
def test_every_omitted_key_reads_as_transformers_default(family: str) -> None:
    """For each key of the family's config.json (as transformers 5 writes it), the file with the key
    left out imports as the file with transformers' default written out: the same config, or the
    same refusal (a default a tiny model cannot take, such as DeepSeek-V3's 128 key/value heads)."""

    def outcome(hf: dict[str, Any]) -> Any:
        try:
            return importer(family)(hf)
        except ValueError as e:
            return str(e)

    full = TINY[family]().to_dict()
    checked = 0
    for key in sorted(full):
        default = transformers_default(family, key)
        if key == "model_type" or default is ABSENT:
            continue
        omitted = {k: v for k, v in full.items() if k != key}
        assert outcome(omitted) == outcome({**full, key: default}), f"{family}: {key} left out"
        checked += 1
    assert checked > 15


# the models whose config.json leaves out the keys that shape them; each key's transformers default
# fits the tiny model (8 heads: Qwen3-MoE's default 4 key/value heads are grouped, Mixtral's 8 are not)
OMITTED = {
    "qwen3_moe": (dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                       num_attention_heads=8, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2,
                       max_position_embeddings=64),
                  ("num_key_value_heads", "rms_norm_eps", "norm_topk_prob", "rope_parameters", "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings", "attention_bias")),
    "mixtral": (dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=8, num_hidden_layers=2,
                     num_attention_heads=8, num_local_experts=4, max_position_embeddings=64),
                ("num_key_value_heads", "rms_norm_eps", "num_experts_per_tok", "rope_parameters", "head_dim",
                 "tie_word_embeddings", "sliding_window", "router_jitter_noise")),
    "deepseek_v3": (dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, moe_intermediate_size=8,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
                         kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                         max_position_embeddings=64),
                    ("n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace", "q_lora_rank",
                     "num_experts_per_tok", "n_shared_experts", "norm_topk_prob", "rope_interleave",
                     "rms_norm_eps", "rope_parameters", "tie_word_embeddings")),
    # the dense checkpoints `dropless upcycle` reads (Qwen3's default head width is 128, not D/H)
    "qwen3": (dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
              ("head_dim", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "attention_bias")),
    "llama": (dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=64),
              ("num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "mlp_bias", "attention_bias")),
}


@pytest.mark.parametrize("family", OMITTED)
def test_omitted_keys_import_the_model_transformers_computes(tmp_path: Path, family: str) -> None:
    """A checkpoint saved by transformers whose config.json then loses the keys that shape the model
    (transformers' defaults apply to them) imports as the same dropless config as the full file, and
    computes the logits of transformers' model, built from the full file and loaded from the short one."""
    args, omit = OMITTED[family]
    hf = save_hf(transformers.CONFIG_MAPPING[family](**args), tmp_path / "full", tokenizer=False)
    full = json.loads((tmp_path / "full" / "config.json").read_text())
    assert all(k in full for k in omit)
    short = tmp_path / "short"
    short.mkdir()
    for f in (tmp_path / "full").iterdir():
        (short / f.name).symlink_to(f)
    (short / "config.json").unlink()
    (short / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k not in omit}))
    if family in mapping.FAMILIES:
        model, _ = import_hf.load_model(short)
    else:
        model = upcycle.load_dense(short, experts=4, top_k=2)
    assert model.cfg == importer(family)(full)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(short, dtype=torch.float32).eval()
    x = tokens(seed=5)
    with torch.no_grad():
        ref = hf(x).logits
        assert_close(loaded(x).logits, ref, REFERENCE[torch.float32], f"{family}: transformers on the short file")
        assert_close(model(x).logits, ref, REFERENCE[torch.float32], f"{family}: dropless on the short file")
