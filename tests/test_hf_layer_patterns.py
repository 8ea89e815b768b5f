"""Which layers are MoE, through import and export (hf/mapping.py moe_layout, hf/deepseek.py
layer_rule): Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step` and DeepSeek-V3's
`first_k_dense_replace` / `moe_layer_freq` as dropless's `model.n_dense_layers` /
`model.moe_layer_freq` (an int, or the list of MoE layers).

Qwen3-MoE: any pattern, checked against transformers' Qwen3MoeForCausalLM (tests/test_hf_parity.py
check_round_trip: its logits on the original, dropless's import and transformers' model of the
export; the files bit for bit). DeepSeek-V3 with moe_layer_freq > 1: transformers ignores the key, so
the check is dropless's own round trip (export, import: the same config and the same tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_models import deepseek_config, qwen3_config
from test_hf_parity import check_round_trip, tokens, write_run

from dropless.config import ModelConfig
from dropless.hf import export_hf, import_hf, mapping
from dropless.model import MoEModel


@pytest.mark.parametrize("kw,moe", [
    (dict(mlp_only_layers=[1]), [0, 2]),  # a dense layer between MoE layers
    (dict(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2), [1, 3]),  # every second layer
])
def test_qwen3_dense_layer_patterns_match_transformers(tmp_path: Path, kw: dict, moe: list[int]) -> None:
    cfg, _ = mapping.model_config(qwen3_config(**kw).to_dict())
    assert (cfg.n_dense_layers, cfg.moe_layer_freq, list(cfg.moe_layer_ids)) == (moe[0], moe, moe)
    assert cfg.moe.balance.aux_loss_coeff == pytest.approx(0.01 * 2 / len(moe))  # per MoE layer
    check_round_trip(tmp_path, qwen3_config(**kw), "qwen3_moe")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    n = kw.get("num_hidden_layers", 3)
    assert (hf["decoder_sparse_step"], hf["mlp_only_layers"]) == (1, [i for i in range(n) if i not in moe])


def _deepseek(n_layers: int, moe_layer_freq: int | list[int]) -> ModelConfig:
    cfg, _ = mapping.model_config(deepseek_config(num_hidden_layers=n_layers).to_dict())
    n_dense = moe_layer_freq[0] if isinstance(moe_layer_freq, list) else cfg.n_dense_layers
    return ModelConfig(**{**vars(cfg), "n_layers": n_layers, "n_dense_layers": n_dense,
                          "moe_layer_freq": moe_layer_freq})


def test_deepseek_moe_layer_freq_round_trip(tmp_path: Path) -> None:
    """MoE layers 2 and 4 of 5 are DeepSeek's rule with first_k_dense_replace 2, moe_layer_freq 2: the
    export writes that pair and the import reads the same layers back, with the same tensors; the
    import of DeepSeek's own config.json (first_k_dense_replace 1, moe_layer_freq 2) gives them too.
    MoE layers 3 and 4 are moe_layer_freq 1 (what transformers computes)."""
    cfg = _deepseek(5, [2, 4])
    torch.manual_seed(0)
    model = MoEModel(cfg).eval()
    write_run(model, tmp_path / "run")
    export_hf.export(tmp_path / "run", tmp_path / "out", "deepseek_v3", max_shard_mb=0.01)
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (hf["first_k_dense_replace"], hf["moe_layer_freq"]) == (2, 2)
    back, _ = import_hf.load_model(tmp_path / "out")
    assert back.cfg.moe_layer_ids == (2, 4) and back.cfg.n_dense_layers == 2
    a, b = model.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    x = tokens(seed=3)
    with torch.no_grad():
        assert torch.equal(model(x).logits, back(x).logits)
    own = {**deepseek_config(num_hidden_layers=5).to_dict(), "first_k_dense_replace": 1, "moe_layer_freq": 2}
    assert mapping.model_config(own)[0].moe_layer_ids == (2, 4)
    tail = mapping.hf_config(_deepseek(5, [3, 4]), "deepseek_v3")
    assert (tail["first_k_dense_replace"], tail["moe_layer_freq"]) == (3, 1)


def test_export_refuses_a_pattern_the_family_cannot_express() -> None:
    """DeepSeek's rule cannot give MoE layer 1 alone of 3 (1 % f == 0 needs f = 1: then layer 2 too);
    Mixtral has no dense layer at all. Qwen3-MoE expresses both."""
    cfg = _deepseek(3, [1])
    with pytest.raises(ValueError, match=r"model\.moe_layer_freq=\[1\]: deepseek_v3 cannot express it"):
        mapping.hf_config(cfg, "deepseek_v3")
    q, _ = mapping.model_config(qwen3_config(mlp_only_layers=[1]).to_dict())
    assert mapping.hf_config(q, "qwen3_moe")["mlp_only_layers"] == [1]
    m, _ = mapping.model_config(qwen3_config(mlp_only_layers=[], num_hidden_layers=4, decoder_sparse_step=2,
                                             norm_topk_prob=True, head_dim=8, attention_bias=False).to_dict())
    with pytest.raises(ValueError, match=r"mixtral cannot express it"):
        mapping.hf_config(m, "mixtral")
