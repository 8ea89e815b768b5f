"""Hugging Face checkpoints in and out, proved against transformers itself (hf/, docs/models.md).

Every model here is a tiny random-weight Qwen3-MoE or Mixtral built with transformers' own config and
model classes and saved with `save_pretrained` in small shards (tests/hf_models.py), so each import
reads an index file and many shards. The Qwen3 config exercises grouped-query attention (4 query heads
on 2 key/value heads), q/k RMSNorm, an explicit head_dim (12, not d/H = 8), a dense first layer, an
untied head, rope theta 5000 and eps 1e-5; norm weights are randomised so a swapped norm shows.

Tolerance: REFERENCE[fp32] (tests/tolerances.py): both sides compute the same function in fp32 and
sum the same products in different orders (one fused qkv GEMM vs three, a grouped expert GEMM vs
transformers' per-expert loop, different SDPA kernels), which is that entry's reason. Measured worst
logit difference 9e-8 (Qwen3) and 6e-8 (Mixtral) on logits of size ~0.5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_models import VOCAB, mixtral_config, qwen3_config, save_hf, transformers
from tolerances import REFERENCE, assert_close

from dropless.config import ModelConfig, RunConfig, TrainConfig, save_config, to_dict
from dropless.hf import export_hf, import_hf, mapping
from dropless.model import MoEModel
from dropless.runs import checkpoint as ckpt
from dropless.runs import dist_checkpoint
from dropless.train.optim import build_optimizer

FAMILIES = {"qwen3_moe": qwen3_config, "mixtral": mixtral_config}


def tokens(seed: int = 1, B: int = 2, S: int = 19) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, S), generator=g)


def hf_grads(hf_model: torch.nn.Module, family: str, model: MoEModel) -> dict[str, mapping.Slot]:
    """transformers' in-memory parameter name -> its Slot (dropless param, region, transposed): the
    on-disk table plus the fused expert layout transformers 5 keeps in memory."""
    table = {s.hf_name: s for s in mapping.slots(model, family) + mapping.fused_slots(model, family)}
    return {n: table[n] for n, _ in hf_model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_import_matches_transformers_logits_and_gradients(tmp_path: Path, family: str) -> None:
    hf = save_hf(FAMILIES[family](), tmp_path)
    assert (tmp_path / import_hf.INDEX_FILE).is_file() and len(import_hf.shard_files(tmp_path)) > 5
    model, got_family = import_hf.load_model(tmp_path)
    assert got_family == family
    if family == "qwen3_moe":  # the variants this test is about are really in play
        c = model.cfg
        assert (c.kv_heads, c.n_heads, c.head_width, c.qk_norm, c.n_dense_layers) == (2, 4, 12, True, 1)
    x = tokens()
    ref = hf(x).logits
    out = model(x)
    assert_close(out.logits, ref, REFERENCE[torch.float32], f"{family} logits")
    # gradients of the same cross-entropy with respect to every parameter, through the table
    y = tokens(seed=2)
    torch.nn.functional.cross_entropy(ref.view(-1, VOCAB), y.view(-1)).backward()
    model(x, y).ce_loss.backward()
    params = dict(model.named_parameters())
    for name, s in hf_grads(hf, family, model).items():
        g = params[s.param].grad
        region = g[s.index] if s.index else g
        region = region.transpose(-1, -2) if s.transpose else region
        hf_grad = dict(hf.named_parameters())[name].grad
        assert hf_grad is not None and hf_grad.abs().max() > 0, name
        assert_close(region, hf_grad, REFERENCE[torch.float32], f"{family} gradient of {name}")


def test_aux_loss_scale_equals_transformers_with_one_moe_layer(tmp_path: Path) -> None:
    """The balancing mapping (hf/mapping.py note): with one MoE layer, dropless's weighted aux loss
    equals transformers' router_aux_loss_coef * aux_loss exactly in math (fp32 rounding apart)."""
    hf = save_hf(qwen3_config(num_hidden_layers=2, output_router_logits=True), tmp_path, tokenizer=False)
    model, _ = import_hf.load_model(tmp_path)
    x = tokens(S=31)
    hf_out = hf(x, output_router_logits=True)
    ours = model(x).moe_loss
    assert_close(ours, hf.config.router_aux_loss_coef * hf_out.aux_loss, REFERENCE[torch.float32], "aux loss")


def write_run(model: MoEModel, run_dir: Path, tokenizer: Path | None = None) -> None:
    """A dropless run directory holding `model` at step 0 (as the trainer writes one)."""
    cfg = RunConfig(model=model.cfg, train=TrainConfig(seq_len=min(256, model.cfg.max_seq_len)))
    if tokenizer is not None:
        cfg.data.tokenizer, cfg.data.tokenizer_path = "hf", str(tokenizer)
    state = {"step": 0, "rng": ckpt.rng_state(), "config": to_dict(cfg), "world_size": 1}
    dist_checkpoint.save(run_dir, 0, model, build_optimizer(model, cfg.train), state)
    save_config(cfg, run_dir / "config.toml")


def check_round_trip(tmp_path: Path, config: object, family: str) -> None:
    """HF -> dropless -> HF, checked against transformers itself, not against our table (import and
    export read the same table, so a table that put a tensor in the wrong place would still give
    identical files): transformers' model of the original checkpoint, dropless's import of it and
    transformers' model of the export compute the same logits; transformers' own state_dict of the
    export equals the original's, key for key and bit for bit; the files hold the same tensors."""
    from safetensors.torch import load_file

    from dropless.runs.load import load_model

    src, run, out = tmp_path / "src", tmp_path / "run", tmp_path / "out"
    hf = save_hf(config, src)
    import_hf.write_run(src, run)
    files = export_hf.export(run, out, family, max_shard_mb=0.01)
    assert (out / import_hf.INDEX_FILE).is_file() and "tokenizer.json" in files
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model, _ = load_model(run)
    x = tokens(seed=9)
    with torch.no_grad():
        ref = hf(x).logits
        assert_close(model.eval()(x).logits, ref, REFERENCE[torch.float32], f"{family}: dropless's import")
        assert torch.equal(back.eval()(x).logits, ref), f"{family}: transformers on the export"
    a, b = hf.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    tensors = [{k: v for f in import_hf.shard_files(d) for k, v in load_file(f).items()} for d in (src, out)]
    assert sorted(tensors[0]) == sorted(tensors[1])
    for k, v in tensors[0].items():
        assert v.dtype == tensors[1][k].dtype and torch.equal(v, tensors[1][k]), k
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_transformers_own_model(tmp_path: Path, family: str) -> None:
    check_round_trip(tmp_path, FAMILIES[family](), family)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path, family: str) -> None:
    """A dropless model of the family's shape with its own random weights (not an imported one):
    transformers loads the export with no missing, unexpected or mismatched keys and computes the
    same logits."""
    cfg, _ = mapping.model_config(FAMILIES[family]().to_dict())
    torch.manual_seed(3)
    model = MoEModel(cfg).eval()
    with torch.no_grad():  # norms and (for Qwen3) q/k norms away from 1, so their mapping matters
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    write_run(model, tmp_path / "run")
    export_hf.export(tmp_path / "run", tmp_path / "out", family, max_shard_mb=0.01)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    x = tokens(seed=4)
    with torch.no_grad():
        assert_close(hf.eval()(x).logits, model(x).logits, REFERENCE[torch.float32], f"{family} export")


def test_tied_embeddings_export_to_mixtral(tmp_path: Path) -> None:
    """dropless's own default model (tied head, multi-head attention) exports as Mixtral: no lm_head
    tensor is written and transformers ties it."""
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, n_dense_layers=0)
    torch.manual_seed(5)
    model = MoEModel(cfg).eval()
    write_run(model, tmp_path / "run")
    export_hf.export(tmp_path / "run", tmp_path / "out", "mixtral")
    assert (tmp_path / "out" / import_hf.SINGLE_FILE).is_file()
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    x = tokens(seed=6)
    with torch.no_grad():
        assert_close(hf.eval()(x).logits, model(x).logits, REFERENCE[torch.float32], "tied mixtral")


def test_export_leaves_out_the_mtp_modules(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A model trained with multi-token prediction exports as its main model: the MTP modules are
    training-only (evaluation never runs them), so transformers loads the export with no missing or
    unexpected keys and computes the dropless model's evaluation logits; stderr says what was left out."""
    import dataclasses

    base, _ = mapping.model_config(qwen3_config().to_dict())
    cfg = dataclasses.replace(base, mtp_depth=2)
    torch.manual_seed(7)
    model = MoEModel(cfg).eval()
    write_run(model, tmp_path / "run")
    export_hf.export(tmp_path / "run", tmp_path / "out", "qwen3_moe", max_shard_mb=0.01)
    n = sum(p.numel() for p in model.mtp.parameters())
    assert f"model.mtp_depth=2: the multi-token prediction modules ({n:,} parameters)" in capsys.readouterr().err
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    x = tokens(seed=8)
    with torch.no_grad():
        assert_close(hf.eval()(x).logits, model(x).logits, REFERENCE[torch.float32], "qwen3 export without MTP")


@pytest.mark.parametrize("family,override,field", [
    ("mixtral", {"score_func": "sigmoid"}, "model.moe.router.score_func"),
    ("mixtral", {"n_groups": 2, "topk_groups": 2}, "model.moe.router.n_groups"),
    ("qwen3_moe", {"use_expert_bias": True}, "model.moe.router.use_expert_bias"),
    ("mixtral", {"renormalize": False}, "model.moe.router.renormalize"),
    ("qwen3_moe", {"scaling_factor": 2.5}, "model.moe.router.scaling_factor"),
])
def test_export_refuses_what_the_family_cannot_express(tmp_path: Path, family: str, override: dict,
                                                       field: str) -> None:
    from dropless.config import apply_overrides

    cfg = RunConfig(model=ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
                                      n_dense_layers=0, qk_norm=family == "qwen3_moe"),
                    train=TrainConfig(seq_len=32))
    cfg = apply_overrides(cfg, [f"model.moe.router.{k}={v}" for k, v in override.items()])
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        mapping.hf_config(cfg.model, family)


def test_qwen3_export_needs_qk_norm() -> None:
    """Qwen3 always normalises q and k: a model without q/k norm is not a Qwen3-MoE (it is a Mixtral)."""
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, n_dense_layers=0)
    with pytest.raises(ValueError, match=r"model\.qk_norm=False: qwen3_moe cannot express it"):
        mapping.hf_config(cfg, "qwen3_moe")
    assert mapping.hf_config(cfg, "mixtral")["model_type"] == "mixtral"


@pytest.mark.parametrize("field,value", [
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
    ("use_sliding_window", True),
    ("hidden_act", "gelu"),
    ("model_type", "llama"),
])
def test_import_refuses_inexpressible_configs(field: str, value: object) -> None:
    hf = qwen3_config().to_dict()
    hf[field] = value
    with pytest.raises(ValueError, match=f"config.json {field.split('.')[0]}"):
        mapping.model_config(hf)


def test_bad_checkpoints_are_refused_by_name(tmp_path: Path) -> None:
    """A missing shard, a tensor whose shape disagrees with config.json, a truncated file and a
    missing tensor each give a ValueError that names it."""
    save_hf(qwen3_config(), tmp_path, tokenizer=False)
    index = json.loads((tmp_path / import_hf.INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    config = json.loads((tmp_path / "config.json").read_text())

    (tmp_path / shards[0]).rename(tmp_path / "moved")
    with pytest.raises(ValueError, match=shards[0]):
        import_hf.load_model(tmp_path)
    (tmp_path / "moved").rename(tmp_path / shards[0])

    bad = dict(config, moe_intermediate_size=config["moe_intermediate_size"] + 1)
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"tensor model\.layers\.\d+\.mlp\.experts\.\d+\.\w+_proj\.weight .* shape"):
        import_hf.load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))

    data = (tmp_path / shards[-1]).read_bytes()
    (tmp_path / shards[-1]).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{shards[-1]}: cannot read"):
        import_hf.load_model(tmp_path)
    (tmp_path / shards[-1]).write_bytes(data)

    from safetensors.torch import load_file, save_file

    victim = next(s for s in shards if any(k.endswith("k_norm.weight") for k in load_file(tmp_path / s)))
    t = load_file(tmp_path / victim)
    dropped = next(k for k in t if k.endswith("k_norm.weight"))
    save_file({k: v for k, v in t.items() if k != dropped}, str(tmp_path / victim), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing tensors: {dropped}"):
        import_hf.load_model(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_reads_fused_experts_and_4x_config_fields(tmp_path: Path, family: str) -> None:
    """Two other spellings of the same checkpoint give the same model: transformers 5's fused
    in-memory expert layout (its `state_dict()`, written as one file, Mixtral's router as
    `mlp.gate.weight`), and a 4.x-style config.json (`rope_theta` at top level, Qwen3's `num_experts`)."""
    from safetensors.torch import save_file

    hf = save_hf(FAMILIES[family](), tmp_path / "a", tokenizer=False)
    fused = tmp_path / "b"
    fused.mkdir()
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)  # really the fused layout
    save_file(sd, str(fused / import_hf.SINGLE_FILE), metadata={"format": "pt"})
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope["rope_theta"]
    if family == "qwen3_moe":
        config["num_experts"] = config.pop("num_local_experts")
    (fused / "config.json").write_text(json.dumps(config))
    a, _ = import_hf.load_model(tmp_path / "a")
    b, _ = import_hf.load_model(fused)
    assert a.cfg == b.cfg
    for (n, p), (m, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n == m and torch.equal(p, q), n
