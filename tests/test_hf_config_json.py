"""config.json across transformers versions (hf/rope.py, hf/mapping.py): what export writes must be
read as the same model by transformers 4.x (which reads `rope_theta` / `rope_scaling`) and 5.x (which
reads `rope_parameters`, or a non-null `rope_scaling`); a file written by 4.x must import as the model
transformers computes from it; a rotary dropless cannot represent, or one the two spellings of a file
disagree on, is refused by name.

The suite runs transformers 5; what 4.x reads is checked against the files transformers 4.57.6 itself
writes for the same models (tests/hf_configs_4x.py, with the keys its config classes take).

Tolerance: REFERENCE[fp32], as tests/test_hf_parity.py (the same function, products summed in other
orders).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_configs_4x import CONFIGS_4X, KEYS_4X
from hf_models import deepseek_config, mixtral_config, qwen3_config, save_hf, transformers
from test_hf_deepseek import YARN
from test_hf_parity import tokens, write_run
from tolerances import REFERENCE, assert_close

from dropless.hf import export_hf, import_hf, mapping
from dropless.model import MoEModel

# the models of tests/hf_configs_4x.py, as transformers 5 configs (Mixtral's theta 1e4, not its default)
CASES = {"qwen3_moe": lambda: qwen3_config(),
         "mixtral": lambda: mixtral_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
         "deepseek_v3": lambda: deepseek_config(), "deepseek_v3_yarn": lambda: deepseek_config(**YARN)}


def as_4x_reads(key: str, value: Any, hf: dict[str, Any]) -> Any:
    """The value transformers 4.57 computes with: a null head_dim is hidden_size // heads (Mixtral),
    and `type` in rope_scaling is copied to `rope_type`, which its modeling reads."""
    if key == "head_dim" and value is None:
        return hf["hidden_size"] // hf["num_attention_heads"]
    if key == "rope_scaling" and value is not None:
        return {k: v for k, v in value.items() if k != "type"}
    return value


@pytest.mark.parametrize("case", CASES)
def test_export_writes_what_transformers_4x_reads(tmp_path: Path, case: str) -> None:
    """Every key transformers 4.57's config class takes for the family is in the exported config.json,
    with the value 4.57 itself writes for the same model (its rotary above all: without `rope_theta`
    4.x takes the class default, 1e6 for Mixtral); and transformers 5 still reads the same rotary."""
    family = case.removesuffix("_yarn")
    cfg, _ = mapping.model_config(CASES[case]().to_dict())
    torch.manual_seed(0)
    write_run(MoEModel(cfg), tmp_path / "run")
    export_hf.export(tmp_path / "run", tmp_path / "out", family)
    ours, ref = json.loads((tmp_path / "out" / "config.json").read_text()), CONFIGS_4X[case]
    for key in KEYS_4X[family]:
        assert key in ours, f"{case}: {key} is missing (transformers 4.x would take its default)"
        assert as_4x_reads(key, ours[key], ours) == as_4x_reads(key, ref.get(key), ref), f"{case}: {key}"
    # the weights' dtype: 4.x reads `torch_dtype` (a loader's dtype="auto" follows it), 5.x `dtype`
    assert ours.get("torch_dtype") == ours["dtype"], f"{case}: torch_dtype is missing (4.x loads its default)"
    five = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert five.rope_parameters == CASES[case]().rope_parameters
    assert str(five.dtype).removeprefix("torch.") == ours["dtype"]


@pytest.mark.parametrize("case", CASES)
def test_config_json_of_transformers_4x_imports_the_model_transformers_computes(tmp_path: Path, case: str) -> None:
    """A checkpoint whose config.json transformers 4.57 wrote (top-level `rope_theta`, `rope_scaling`,
    no `rope_parameters`) imports as the model of its 5.x config.json, with its theta, and computes
    the logits of transformers' own model (built from the 5.x config, and loaded from the 4.x file)."""
    hf = save_hf(CASES[case](), tmp_path, tokenizer=False)
    five, _ = mapping.model_config(json.loads((tmp_path / "config.json").read_text()))
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS_4X[case]))
    model, _ = import_hf.load_model(tmp_path)
    assert model.cfg == five and model.cfg.rope_theta == CONFIGS_4X[case]["rope_theta"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = tokens(seed=3, S=50)
    with torch.no_grad():
        ref = hf(x).logits
        assert_close(model(x).logits, ref, REFERENCE[torch.float32], f"{case} import of the 4.x config.json")
        assert_close(loaded(x).logits, ref, REFERENCE[torch.float32], f"{case}: transformers 5 on the 4.x file")


def _with(hf: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = {k: v for k, v in hf.items() if k not in changes or changes[k] is not ...}
    out.update({k: v for k, v in changes.items() if v is not ...})
    return out


QWEN, MIXTRAL, DEEPSEEK = CONFIGS_4X["qwen3_moe"], CONFIGS_4X["mixtral"], CONFIGS_4X["deepseek_v3_yarn"]
YARN_4X = DEEPSEEK["rope_scaling"]


@pytest.mark.parametrize("hf,field", [
    (_with(QWEN, rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling.rope_type"),
    (_with(QWEN, rope_scaling={"type": "yarn", "factor": 2.0}), "rope_scaling.rope_type"),
    (_with(QWEN, partial_rotary_factor=0.5), "partial_rotary_factor"),
    (_with(QWEN, rope_theta=..., rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.5}), "rope_parameters.partial_rotary_factor"),
    (_with(QWEN, rope_theta=..., rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters.full_attention"),
    (_with(QWEN, rope_theta=None), "rope_theta"),
    # two spellings, two rotaries: 4.x reads rope_theta, 5.x rope_parameters
    (_with(MIXTRAL, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}), "rope_parameters"),
    (_with(DEEPSEEK, rope_scaling=None, rope_parameters={**YARN_4X, "rope_theta": 500.0}), "rope_parameters"),
    (_with(DEEPSEEK, rope_scaling={**YARN_4X, "rope_theta": 100.0}), "rope_scaling.rope_theta"),
    (_with(DEEPSEEK, rope_scaling={**YARN_4X, "attention_factor": 0.5}), "rope_scaling.attention_factor"),
    (_with(DEEPSEEK, rope_scaling={**YARN_4X, "type": "dynamic"}), "rope_scaling.type"),
])
def test_import_refuses_a_rotary_it_cannot_represent_or_that_is_ambiguous(hf: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"config.json {field}=")):
        mapping.model_config(hf)


def test_a_file_whose_spellings_agree_imports() -> None:
    """What export writes (all three keys, the same rotary) imports as the file with one spelling; a
    file with `rope_parameters` alone (what transformers 5 writes) is read as 5.x reads it."""
    plain = _with(QWEN, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    yarn = _with(DEEPSEEK, rope_parameters={**{k: v for k, v in YARN_4X.items() if k != "type"}, "rope_theta": 500.0})
    assert mapping.model_config(plain)[0] == mapping.model_config(QWEN)[0]
    assert mapping.model_config(yarn)[0] == mapping.model_config(DEEPSEEK)[0]
    five = _with(MIXTRAL, rope_theta=..., rope_parameters={"rope_type": "default", "rope_theta": 2e4})
    assert mapping.model_config(five)[0].rope_theta == 2e4
