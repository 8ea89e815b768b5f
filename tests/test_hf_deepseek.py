"""DeepSeek-V3 in and out, proved against transformers' DeepseekV3ForCausalLM (hf/deepseek.py,
layers/mla.py, hf/fp8.py, docs/deepseek_v3.md).

The tiny model (tests/hf_models.py deepseek_config) has everything the family adds: multi-head latent
attention with a low-rank query, value heads narrower than query/key heads and the interleaved rotary
layout; sigmoid routing with a random (nonzero) correction bias, 8 experts in 4 groups of which 2 are
eligible, top-3, routed_scaling_factor 2.5; two shared experts; a dense first layer.

Tolerances: REFERENCE[fp32] for logits and gradients, as tests/test_hf_parity.py (the same function in
fp32, products summed in other orders); KV_DECODE for cached decoding (tests/tolerances.py reasons).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hf_models import VOCAB, deepseek_config, save_hf, transformers
from test_hf_parity import check_round_trip, hf_grads, tokens, write_run
from tolerances import E4M3_REL, E4M3_SUBNORMAL, KV_DECODE, REFERENCE, assert_close

from dropless.config import ModelConfig
from dropless.hf import export_hf, fp8, import_hf, mapping
from dropless.model import MoEModel
from dropless.ops import routing

FAMILY = "deepseek_v3"
# YaRN as DeepSeek-V3 uses it (mscale, mscale_all_dim), at a shape where one rotary frequency is
# extrapolated, one interpolated and two blended (rope dim 8, theta 500, original context 32)
YARN = dict(qk_rope_head_dim=8, max_position_embeddings=64,
            rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 2.0,
                             "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                             "mscale": 1.0, "mscale_all_dim": 0.8})


def test_import_matches_transformers_logits_and_gradients(tmp_path: Path) -> None:
    hf = save_hf(deepseek_config(), tmp_path)
    assert len(import_hf.shard_files(tmp_path)) > 5
    model, family = import_hf.load_model(tmp_path)
    c, r = model.cfg, model.cfg.moe.router
    assert family == FAMILY and c.attention == "mla" and c.n_dense_layers == 1 and c.moe.shared_width == 24
    assert (r.score_func, r.n_groups, r.topk_groups, r.scaling_factor) == ("sigmoid", 4, 2, 2.5)
    bias = model.blocks[1].ffn.router.expert_bias
    assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias) and bias.abs().max() > 0
    x = tokens()
    # the group limit and the bias really change some token's experts (else the test would not see them)
    h = model.blocks[1].ffn_norm(model.embed(x) + model.blocks[1].attn(model.blocks[0].attn_norm(model.embed(x)),
                                                                      model.rope_cos[:19], model.rope_sin[:19]))
    logits_TE = model.blocks[1].ffn.router.logits(h.reshape(-1, c.d_model))
    plain = routing.topk_route(logits_TE, top_k=3, score_func="sigmoid")[0].sort(-1).values
    grouped = routing.topk_route(logits_TE, top_k=3, score_func="sigmoid", n_groups=4, topk_groups=2,
                                 bias_E=bias)[0].sort(-1).values
    assert not torch.equal(plain, grouped)
    ref = hf(x).logits
    out = model(x)
    assert_close(out.logits, ref, REFERENCE[torch.float32], "deepseek_v3 logits")
    y = tokens(seed=2)
    torch.nn.functional.cross_entropy(ref.view(-1, VOCAB), y.view(-1)).backward()
    model(x, y).ce_loss.backward()
    params = dict(model.named_parameters())
    names = hf_grads(hf, FAMILY, model)
    assert any("q_a_proj" in n for n in names) and any("shared_experts" in n for n in names)
    for name, s in names.items():
        g = params[s.param].grad
        region = g[s.index] if s.index else g
        region = region.transpose(-1, -2) if s.transpose else region
        hf_grad = dict(hf.named_parameters())[name].grad
        assert hf_grad is not None and hf_grad.abs().max() > 0, name
        assert_close(region, hf_grad, REFERENCE[torch.float32], f"deepseek_v3 gradient of {name}")


@pytest.mark.parametrize("kw", [dict(q_lora_rank=None, rope_interleave=False),
                                dict(num_experts_per_tok=1, n_group=2, topk_group=1, attention_bias=True),
                                YARN])
def test_variants_match_transformers(tmp_path: Path, kw: dict) -> None:
    """A full-rank query with the plain rotary layout; top-1 (renormalised to the scale factor) with
    attention biases and two groups of four; YaRN rotary with its softmax mscale, on 50 positions
    (past the original 32)."""
    hf = save_hf(deepseek_config(**kw), tmp_path, tokenizer=False)
    model, _ = import_hf.load_model(tmp_path)
    if kw is YARN:
        assert model.cfg.rope_yarn.factor == 2.0 and model.blocks[0].attn.scale is not None
    x = tokens(seed=7, S=50)
    with torch.no_grad():
        assert_close(model(x).logits, hf(x).logits, REFERENCE[torch.float32], f"deepseek_v3 {kw}")


def test_round_trip_is_transformers_own_model(tmp_path: Path) -> None:
    """tests/test_hf_parity.py check_round_trip, with the correction bias in the checkpoint."""
    check_round_trip(tmp_path, deepseek_config(), FAMILY)


@pytest.mark.parametrize("kw", [{}, YARN])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path, kw: dict) -> None:
    """A dropless MLA model with its own random weights and expert bias (plain and YaRN rotary):
    transformers loads the export with no missing, unexpected or mismatched keys and computes the
    same logits."""
    cfg, _ = mapping.model_config(deepseek_config(**kw).to_dict())
    torch.manual_seed(3)
    model = MoEModel(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        for layer in model.moe_layers():
            layer.router.expert_bias.normal_(0.0, 0.1)
    write_run(model, tmp_path / "run")
    export_hf.export(tmp_path / "run", tmp_path / "out", FAMILY, max_shard_mb=0.01)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    x = tokens(seed=4, S=50)
    with torch.no_grad():
        assert_close(hf.eval()(x).logits, model(x).logits, REFERENCE[torch.float32], "deepseek_v3 export")


def test_deepseek_rope_scaling_spelling_gives_the_same_model() -> None:
    """DeepSeek-V3's published config.json spells YaRN as 4.x `rope_scaling` (`type: yarn`) beside a
    top-level `rope_theta`: the same model as transformers 5's `rope_parameters`."""
    a = deepseek_config(**YARN).to_dict()
    b = dict(a)
    params = dict(b.pop("rope_parameters"))
    b["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    b["rope_scaling"] = params
    assert mapping.model_config(a)[0] == mapping.model_config(b)[0]


def test_kv_cache_and_generate_match_the_full_forward() -> None:
    """MLA's cache (full per-head k [Dqk] and v [Dv]): left-padded prefill + cached steps against the
    plain forward of each sequence alone; greedy generate with and without the cache agree."""
    from serve.test_kv_cache import cached_logits

    from dropless.layers.kv_cache import KVCache
    from dropless.serve.generate import generate

    cfg, _ = mapping.model_config(deepseek_config().to_dict())
    torch.manual_seed(0)
    model = MoEModel(cfg).eval()
    cache = KVCache.for_model(model, 2, 8)
    assert cache.layers[0].shape == (2, 4, 8, 10) and cache.layers[0].v_shape == (2, 4, 8, 5)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (18, 12)]
    got = cached_logits(model, seqs, [11, 4], 6)
    with torch.no_grad():
        for b, (s, n) in enumerate(zip(seqs, [11, 4])):
            assert_close(got[b], model(s[:n + 6].unsqueeze(0)).logits[0], KV_DECODE, msg=f"sequence {b}")
    prompts = [s[:n].tolist() for s, n in zip(seqs, [11, 4])]
    a = generate(model, prompts, 8, temperature=0.0, use_cache=True)
    b = generate(model, prompts, 8, temperature=0.0, use_cache=False)
    assert a.tokens == b.tokens


def _quantise(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's recipe: per block, scale = amax / 448 (e4m3's largest), store w / scale in e4m3 and
    1 / (1 / scale) = scale as `scale_inv` (what multiplies back)."""
    R, C = w.shape
    Rb, Cb = -(-R // block), -(-C // block)
    scale = torch.zeros(Rb, Cb)
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    for i in range(Rb):
        for j in range(Cb):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = blk.abs().max().clamp_min(1e-12) / 448.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def _reference_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = torch.empty(q.shape)
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            out[r, c] = q[r, c].float() * scale[r // block[0], c // block[1]]
    return out


def test_fp8_block_weights_are_dequantised_on_import(tmp_path: Path) -> None:
    """Every linear weight except embeddings, head and router quantised to e4m3 in 8x8 blocks (the
    tiny model's widths are below 128; the block size comes from config.json) with the scales in
    other shards than some weights: import equals a per-element reference dequantisation exactly and
    the original within e4m3's rounding (3 mantissa bits: 2^-4 relative, subnormal step 2^-9 x scale)."""
    from safetensors.torch import load_file, save_file

    src, q8 = tmp_path / "src", tmp_path / "fp8"
    save_hf(deepseek_config(), src, tokenizer=False)
    orig = {k: v for f in import_hf.shard_files(src) for k, v in load_file(f).items()}
    block = (8, 8)
    quantised, scales, ref = {}, {}, {}
    for k, v in orig.items():
        if v.dim() == 2 and "embed" not in k and "lm_head" not in k and not k.endswith("gate.weight"):
            q, s = _quantise_block(v, block)
            quantised[k], scales[k + "_scale_inv"], ref[k] = q, s, _reference_dequant(q, s, block)
        else:
            quantised[k] = v
    q8.mkdir()
    names = sorted(quantised) + sorted(scales)  # scales after all weights: in other shards than theirs
    weight_map, shard = {}, 0
    everything = {**quantised, **scales}
    for i in range(0, len(names), 40):
        part = {n: everything[n].contiguous() for n in names[i:i + 40]}
        fname = f"model-{shard:05d}.safetensors"
        save_file(part, str(q8 / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
        shard += 1
    (q8 / import_hf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                     "activation_scheme": "dynamic"}
    (q8 / "config.json").write_text(json.dumps(config))
    model, _ = import_hf.load_model(q8)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    slots = {s.hf_name: s for s in mapping.slots(model, FAMILY)}
    assert len(ref) > 50
    for k, want in ref.items():
        s = slots[k]
        got = params[s.param][s.index] if s.index else params[s.param]
        got = got.transpose(-1, -2) if s.transpose else got
        assert torch.equal(got, want), k
        scale = scales[k + "_scale_inv"].repeat_interleave(8, 0)[:want.shape[0]].repeat_interleave(8, 1)[:, :want.shape[1]]
        assert ((got - orig[k]).abs() <= E4M3_REL * orig[k].abs() + E4M3_SUBNORMAL * scale).all(), k
        assert not torch.equal(got, orig[k]), k  # really quantised
    del config["quantization_config"]  # without it the float8 tensors are refused by name
    (q8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="dtype torch.float8_e4m3fn is not supported"):
        import_hf.load_model(q8)


def _quantise_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    assert block[0] == block[1]
    return _quantise(w, block[0])


def test_fp8_dequantize_rejects_a_scale_grid_that_does_not_fit() -> None:
    q = torch.zeros(10, 20, dtype=torch.float8_e4m3fn)
    assert fp8.dequantize(q, torch.ones(2, 3), (8, 8)).shape == (10, 20)
    with pytest.raises(ValueError, match=r"expected \(2, 3\)"):
        fp8.dequantize(q, torch.ones(2, 2), (8, 8))


@pytest.mark.parametrize("field,value", [
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
    ("rope_parameters.attention_factor", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                          "original_max_position_embeddings": 16, "attention_factor": 0.5}),
    ("moe_layer_freq", 0),
    ("num_key_value_heads", 2),
    ("n_shared_experts", 0),
    ("scoring_func", "softmax"),
    ("quantization_config", {"quant_method": "bitsandbytes"}),
])
def test_import_refuses_what_dropless_cannot_express(tmp_path: Path, field: str, value: object) -> None:
    save_hf(deepseek_config(), tmp_path, tokenizer=False)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf[field.split(".")[0]] = value
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=f"config.json {field}"):
        import_hf.load_model(tmp_path)


@pytest.mark.parametrize("override,field", [
    ({"attention": "standard", "head_dim": 0, "q_lora_rank": 0, "kv_lora_rank": 0, "rope_head_dim": 0,
      "v_head_dim": 0, "rope_interleave": False}, "model.attention"),
    ({"moe.router.score_func": "softmax"}, "model.moe.router.score_func"),
    ({"moe.n_shared_experts": 0}, "model.moe.n_shared_experts"),
])
def test_export_refuses_what_deepseek_cannot_express(override: dict, field: str) -> None:
    from dropless.config import RunConfig, TrainConfig, apply_overrides

    cfg, _ = mapping.model_config(deepseek_config().to_dict())
    run = apply_overrides(RunConfig(model=cfg, train=TrainConfig(seq_len=32)),
                          [f"model.{k}={v}" for k, v in override.items()])
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + ".*deepseek_v3 cannot express it"):
        mapping.hf_config(run.model, FAMILY)


def test_mixtral_and_qwen3_refuse_latent_attention() -> None:
    cfg, _ = mapping.model_config(deepseek_config().to_dict())
    for family in ("mixtral", "qwen3_moe"):
        with pytest.raises(ValueError, match=f"model.attention='mla': {family} cannot express it"):
            mapping.hf_config(cfg, family)


def test_fine_tuning_uses_the_loss_free_bias_rule(tmp_path: Path) -> None:
    """The family's balancing rule is on by default and the run log says which."""
    save_hf(deepseek_config(), tmp_path, tokenizer=False)
    hf = json.loads((tmp_path / "config.json").read_text())
    cfg, _ = mapping.model_config(hf)
    b = cfg.moe.balance
    assert cfg.moe.router.use_expert_bias and b.bias_update_rate > 0 and b.aux_loss_coeff == 0
    line = import_hf.describe_balancing(cfg, hf)
    assert "loss-free expert-bias balancing, step 0.001 per optimizer step (deepseek_v3's rule)" in line


def test_config_refuses_mla_fields_on_standard_attention() -> None:
    with pytest.raises(ValueError, match=r"model\.kv_lora_rank=8: is a field of model.attention='mla'"):
        ModelConfig(kv_lora_rank=8)
    with pytest.raises(ValueError, match=r"model\.rope_head_dim=0"):
        ModelConfig(attention="mla", kv_lora_rank=8, head_dim=16)
    with pytest.raises(ValueError, match=r"model\.n_kv_heads=2"):
        ModelConfig(attention="mla", kv_lora_rank=8, head_dim=16, rope_head_dim=4, n_kv_heads=2)


def test_init_from_trains_with_the_bias_rule_and_exports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dropless train --init-from hf:DIR` on the tiny DeepSeek-V3: the log names the loss-free bias
    rule, training moves the correction bias (the rule acts), and the trained run exports to a folder
    transformers loads with dropless's logits."""
    from test_hf_cli import SMOKE, sets

    from dropless.cli import main as cli
    from dropless.runs.load import load_model

    src, run, out = tmp_path / "src", tmp_path / "run", tmp_path / "out"
    save_hf(deepseek_config(), src)
    before, _ = import_hf.load_model(src)
    assert cli(["train", "--init-from", f"hf:{src}", "--run-dir", str(run), *sets(*SMOKE, "train.steps=3")]) == 0
    assert "balancing: sequence aux loss 0.0001; loss-free expert-bias balancing, step 0.001" in capsys.readouterr().out
    model, _ = load_model(run)
    moved = model.blocks[1].ffn.router.expert_bias - before.blocks[1].ffn.router.expert_bias
    assert 0 < moved.abs().max() <= 3 * 1e-3 + 1e-6  # three sign steps of 1e-3 at most
    assert cli(["export-hf", str(run), "--out", str(out), "--family", FAMILY, "--max-shard-size-mb", "0.02"]) == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    x = tokens(seed=8)
    with torch.no_grad():
        assert_close(hf.eval()(x).logits, model(x).logits, REFERENCE[torch.float32], "trained, exported")


def test_bad_deepseek_checkpoints_are_refused_by_name(tmp_path: Path) -> None:
    """A latent width that disagrees with the tensors, a missing correction bias and a float8 weight
    whose scale is missing each give a ValueError naming the tensor."""
    from safetensors.torch import load_file, save_file

    save_hf(deepseek_config(), tmp_path, tokenizer=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "kv_lora_rank": 11}))
    with pytest.raises(ValueError, match=r"tensor model\.layers\.\d\.self_attn\.kv_\w+\.weight in .*: shape .*, but config\.json implies"):
        import_hf.load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    index = json.loads((tmp_path / import_hf.INDEX_FILE).read_text())
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    shard = tmp_path / index["weight_map"][bias]
    t = load_file(shard)
    save_file({k: v for k, v in t.items() if k != bias}, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing tensors: {bias}"):
        import_hf.load_model(tmp_path)
    save_file(t, str(shard), metadata={"format": "pt"})
    w = "model.layers.0.self_attn.kv_b_proj.weight"
    shard = tmp_path / index["weight_map"][w]
    t = load_file(shard)
    save_file({**t, w: t[w].to(torch.float8_e4m3fn)}, str(shard), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match=f"tensor {w} in .*: float8 weight without its {w}_scale_inv"):
        import_hf.load_model(tmp_path)
    with pytest.raises(ValueError, match=r"model\.offload=\['attn_input'\]"):  # it hooks the fused qkv
        ModelConfig(attention="mla", kv_lora_rank=8, head_dim=16, rope_head_dim=4, offload=["attn_input"])


def test_recompute_and_offload_of_latent_attention_are_bit_identical() -> None:
    """Activation recompute and offload rerun / restore the same latent attention: loss and every
    gradient equal the plain backward's bit for bit (what the other attention variants guarantee)."""
    cfg0, _ = mapping.model_config(deepseek_config().to_dict())
    grads = []
    for extra in ({}, {"recompute": ["layer"]}, {"recompute": ["attn", "norm"]}, {"offload": ["attn"]}):
        torch.manual_seed(0)
        model = MoEModel(replace(cfg0, **extra))
        x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
        out = model(x, x)
        out.loss.backward()
        grads.append([out.loss] + [p.grad for p in model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)


def test_deepseek_v3_full_size_config_translates() -> None:
    """A config.json with DeepSeek-V3's full shape and its own spellings (4.x `rope_scaling` yarn,
    `scoring_func`, `topk_method`, `moe_layer_freq`, one MTP layer, block FP8): translated without
    building the model."""
    hf = {"model_type": "deepseek_v3", "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
          "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
          "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
          "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
          "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-6,
          "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]},
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"},
          "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
          "topk_group": 4, "topk_method": "noaux_tc", "vocab_size": 129280, "attention_bias": False}
    cfg, _ = mapping.model_config(hf)
    assert (cfg.head_width, cfg.rope_head_dim, cfg.value_width, cfg.n_dense_layers) == (192, 64, 128, 3)
    assert cfg.mtp_depth == 0  # no tensor names: the config alone does not say the layer is there
    with_mtp, _ = mapping.model_config(hf, ["model.layers.60.mlp.gate.weight", "model.layers.61.eh_proj.weight"])
    assert (with_mtp.mtp_depth, with_mtp.mtp_block) == (1, "moe")
    assert (cfg.rope_yarn.factor, cfg.rope_yarn.original_max_seq_len, cfg.moe.shared_width) == (40.0, 4096, 2048)
    assert fp8.block_size(hf) == (128, 128)
