"""`export-hf --adapters-only`: a LoRA run's adapters as a peft folder (hf/peft_export.py), proved
against peft and transformers themselves.

A tiny random-weight HF checkpoint (tests/hf_models.py, fp32) is fine-tuned with LoRA for a few
steps at a large learning rate (so every B is far from zero: the adapted logits move by ~0.5), then
four models must compute the same logits and the same greedy tokens (3 prompts, 64 new tokens each):
    1. the LoRA run (hf/load_run.py: the base from train.lora.base_from, the adapters)
    2. the merged run (dropless merge-lora)
    3. transformers' base + peft's PeftModel.from_pretrained(the adapter folder)
    4. transformers' load of export-hf of the merged run
The Qwen3-MoE run adapts a subset of layers (0: dense, 2: MoE; layer 1 left alone, which peft must
leave alone too) with attention, dense MLP, routed experts and a trained router; the DeepSeek-V3 run
adapts every layer's MLA (both latent projections too), shared experts, dense MLP and routed
experts, and its loss-free balancing moves the routers' bias, which the folder must carry; the
Mixtral run adapts attention and routed experts and trains the routers (peft converts Mixtral's
config by its own table, w1/w3/w2).

Tolerance: REFERENCE[fp32] (tests/tolerances.py): the four compute one function in fp32 and differ
in the order of the same products (peft's parameter targets add s B A to the weight before the
product, dropless multiplies by the adapter apart; merging adds it once; a fused qkv GEMM against
three). Measured worst logit difference, peft against the LoRA run: 1.2e-7 (Qwen3-MoE), 1.5e-7
(DeepSeek-V3).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_models import VOCAB, deepseek_config, mixtral_config, qwen3_config, save_hf, transformers
from tolerances import REFERENCE, assert_close

from dropless.cli import main as cli
from dropless.config import apply_overrides, load_config
from dropless.hf import import_hf, peft_export
from dropless.hf.load_run import load_model
from dropless.model import MoEModel
from dropless.serve.generate import generate

peft = pytest.importorskip("peft")
from peft.utils import get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

# a few steps of 2 x 32 tokens, fp32 on the CPU, quiet; lr 1e-2 so that the adapters move far from zero
STEPS = ["train.steps=4", "train.warmup_steps=0", "train.batch_size=2", "train.seq_len=32", "train.lr=1e-2",
         "train.eval_batches=1", "train.device=cpu", "train.dtype=fp32", "data.max_bytes=100000",
         "log.progress=false", "log.plots=false", "log.tensorboard=false", "train.lora.rank=4",
         "train.optimizer=adamw"]
CASES = {  # family: (config builder, train.lora overrides)
    "qwen3_moe": (qwen3_config, ['train.lora.targets=["attn","dense","experts","router"]', "train.lora.layers=[0,2]"]),
    "deepseek_v3": (deepseek_config, ['train.lora.targets=["attn","mla_low_rank","shared","dense","experts"]']),
    "mixtral": (mixtral_config, ['train.lora.targets=["attn","experts","router"]']),
}
NEW_TOKENS = 64


def sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 13)]


@pytest.fixture(scope="module", params=list(CASES))
def lora_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(family, the HF base folder, the trained LoRA run); room for 64 new tokens after a prompt."""
    family = request.param
    build, overrides = CASES[family]
    root = tmp_path_factory.mktemp(family)
    base, run = root / "base", root / "run"
    save_hf(build(max_position_embeddings=128), base)
    assert cli(["train", "--init-from", f"hf:{base}", "--run-dir", str(run), *sets(STEPS + overrides)]) == 0
    return family, base, run


def hf_base(base: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # 64 tokens whatever is picked, as dropless generates
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model: torch.nn.Module) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts():
            x = torch.tensor([p])  # (the mask given: generate would mask the pad id's tokens out of the prompt)
            ids = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.slow
def test_adapters_load_in_peft_and_compute_the_run(lora_run: tuple[str, Path, Path], tmp_path: Path) -> None:
    family, base, run = lora_run
    adapters, merged, export = tmp_path / "adapters", tmp_path / "merged", tmp_path / "export"
    assert cli(["export-hf", str(run), "--out", str(adapters), "--family", family, "--adapters-only",
                "--no-progress"]) == 0
    assert sorted(p.name for p in adapters.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    written = load_file(adapters / "adapter_model.safetensors")
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["peft_version"] == "0.21.2"
    assert cli(["merge-lora", str(run), "--out", str(merged)]) == 0
    assert cli(["export-hf", str(merged), "--out", str(export), "--family", family]) == 0

    ours, _ = load_model(run)
    ours_merged, _ = load_model(merged)
    with_peft = peft.PeftModel.from_pretrained(hf_base(base), adapters).eval()
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32,
                                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    exported.generation_config.eos_token_id, exported.generation_config.pad_token_id = None, 0

    # peft read every tensor of the folder into the model (none left at its own initial values), and
    # its own save_pretrained of what it loaded writes the same tensors and the same config fields
    again = tmp_path / "again"
    with_peft.save_pretrained(again)
    assert sorted(get_peft_model_state_dict(with_peft)) == sorted(written)
    resaved = load_file(again / "adapter_model.safetensors")
    assert sorted(resaved) == sorted(written) and all(torch.equal(resaved[k], written[k]) for k in written)
    peft_config = json.loads((again / "adapter_config.json").read_text())
    norm = lambda v: sorted(v) if isinstance(v, list) else v  # noqa: E731 (peft keeps the lists as sets)
    assert {k: norm(peft_config[k]) for k in config} == {k: norm(v) for k, v in config.items()}

    # peft adapted exactly the modules the folder holds adapters for: no other layer, no other module
    # of the same short name (a dense gate_proj against an expert's)
    lora_names = {n.removeprefix("base_model.model.").rsplit(".lora_A", 1)[0]
                  for n, _ in with_peft.named_modules() if n.endswith("lora_A")}
    assert lora_names == {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in written if ".lora_" in k}
    if family == "qwen3_moe":  # layer 1 (MoE) is not in train.lora.layers
        assert not any(".layers.1." in n for n in lora_names)
        assert config["modules_to_save"] == ["model.layers.2.mlp.gate"]  # the trained router
    elif family == "mixtral":  # every layer's router trained (transformers 5's name: mlp.gate)
        assert config["modules_to_save"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    else:  # the routers did not train, but their balancing bias moved: saved with the base's weight
        assert config["modules_to_save"] == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
        base_model = hf_base(base)
        for i in (1, 2):
            gate = f"base_model.model.model.layers.{i}.mlp.gate."
            assert torch.equal(written[gate + "weight"], base_model.model.layers[i].mlp.gate.weight)
            assert not torch.equal(written[gate + "e_score_correction_bias"],
                                   base_model.model.layers[i].mlp.gate.e_score_correction_bias)

    x = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ours(x).logits
        assert not torch.allclose(ref, hf_base(base)(x).logits, atol=0.1)  # the adapters matter
        for name, model in (("merged", ours_merged), ("peft", with_peft), ("exported merged", exported)):
            assert_close(model(x).logits, ref, REFERENCE[torch.float32], f"{family}: {name} logits")

    tokens = generate(ours, prompts(), NEW_TOKENS, temperature=0).tokens
    assert [len(t) for t in tokens] == [NEW_TOKENS] * 3
    assert generate(ours_merged, prompts(), NEW_TOKENS, temperature=0).tokens == tokens
    assert hf_greedy(with_peft) == tokens
    assert hf_greedy(exported) == tokens


@pytest.mark.slow
def test_a_lora_run_exports_only_as_adapters(lora_run: tuple[str, Path, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """export-hf of a LoRA run (its checkpoint holds no base) refuses and names both ways out; a
    refusal writes nothing."""
    family, _, run = lora_run
    capsys.readouterr()
    assert cli(["export-hf", str(run), "--out", str(tmp_path / "out"), "--family", family]) == 2
    err = capsys.readouterr().err
    assert "a LoRA run (train.lora.rank=4)" in err and "--adapters-only" in err and "dropless merge-lora" in err
    other = "deepseek_v3" if family == "mixtral" else "mixtral"  # (a family the run's model does not fit)
    assert cli(["export-hf", str(run), "--out", str(tmp_path / "out"), "--family", other, "--adapters-only",
                "--no-progress"]) == 2
    assert f"{other} cannot express it" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_expert_layout_is_peft_delta() -> None:
    """experts_A / experts_B: peft's ParamWrapper over transformers 5's fused gate_up_proj [E, 2F, D]
    adds exactly s (a1[e] b1[e])^T to expert e, and s (a2[e] b2[e])^T to down_proj [E, D, F]: its
    own get_delta_weight on the tensors the export writes (module note's derivation)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(qwen3_config(), dtype=torch.float32)
    E, D, F, r, alpha = 5, 32, 24, 3, 6.0  # r = 3: no square shape to hide a transpose
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=r, lora_alpha=alpha, target_parameters=[
        "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]))
    outer = pm.base_model.model.model.layers[1].mlp.experts
    inner = outer.base_layer
    assert (inner.parameter_name, outer.parameter_name) == ("gate_up_proj", "down_proj")
    a1, b1, a2, b2 = torch.randn(E, D, r), torch.randn(E, r, 2 * F), torch.randn(E, F, r), torch.randn(E, r, D)
    with torch.no_grad():
        for wrapper, a, b in ((inner, a1, b1), (outer, a2, b2)):
            wrapper.lora_A["default"].weight.copy_(peft_export.experts_A(a))
            wrapper.lora_B["default"].weight.copy_(peft_export.experts_B(b))
    s = alpha / r
    assert_close(inner.get_delta_weight("default"), s * torch.bmm(a1, b1).transpose(1, 2), REFERENCE[torch.float32])
    assert_close(outer.get_delta_weight("default"), s * torch.bmm(a2, b2).transpose(1, 2), REFERENCE[torch.float32])


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen_cfg")
    save_hf(qwen3_config(), d)
    return d


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("deepseek_cfg")
    save_hf(deepseek_config(), d)
    return d


@pytest.mark.parametrize("case", ["not_lora", "seed_base", "dropout_dense", "dropout_shared", "family"])
def test_refusals_name_the_field_and_target(case: str, qwen_dir: Path, deepseek_dir: Path) -> None:
    """What peft cannot hold is refused by the field and the target, from the config alone."""
    hf_dir = deepseek_dir if case == "dropout_shared" else qwen_dir
    base = import_hf.init_config(hf_dir, load_config(None), [])
    lora = {"not_lora": [],
            "seed_base": ["train.lora.rank=4"],
            "dropout_dense": ["train.lora.rank=4", 'train.lora.targets=["attn","dense"]', "train.lora.dropout=0.1",
                              f"train.lora.base_from=hf:{hf_dir}"],
            "dropout_shared": ["train.lora.rank=4", 'train.lora.targets=["attn","shared"]', "train.lora.dropout=0.1",
                               f"train.lora.base_from=hf:{hf_dir}"],
            "family": ["train.lora.rank=4", f"train.lora.base_from=hf:{hf_dir}"]}[case]
    cfg = apply_overrides(base, lora)
    family = {"family": "mixtral", "dropout_shared": "deepseek_v3"}.get(case, "qwen3_moe")
    with torch.device("meta"):
        model = MoEModel(cfg.model, lora=cfg.train.lora if cfg.train.lora.enabled else None)
    expect = {"not_lora": "train.lora.rank=0: not a LoRA run",
              "seed_base": "train.lora.base_from='': the base is the initial weights of train.seed",
              "dropout_dense": "train.lora.dropout=0.1 with 'dense' in train.lora.targets: peft 0.21.2 holds it "
                               "under transformers 5 only as a parameter target (model.layers.0.mlp.gate_proj.weight",
              "dropout_shared": "train.lora.dropout=0.1 with 'shared' in train.lora.targets: peft 0.21.2 holds "
                                "it under transformers 5 only as a parameter target "
                                "(model.layers.1.mlp.shared_experts.gate_proj.weight",
              "family": "model.qk_norm=True: mixtral cannot express it"}[case]
    with pytest.raises(ValueError) as err:
        peft_export.refuse(cfg, family, model)
    assert expect in str(err.value)
