"""DeepSeek-V3's multi-token-prediction layers in and out (hf/deepseek.py, layers/mtp.py,
model.mtp_block "moe").

transformers neither builds nor saves the MTP layers, so the checkpoint here is a tiny DeepSeek-V3
saved by transformers (tests/hf_models.py, 3 layers) with one MTP layer added by hand under
DeepSeek's names: `model.layers.3.` holds enorm, hnorm, eh_proj [D, 2D], shared_head.norm, the
copies of the embedding and the head, and a whole MoE decoder layer (random values; its names are
those of transformers' MoE layer 1). The MTP module's forward is checked against DeepSeek's formula
written out here with transformers' own decoder layer as the block.

Tolerances: REFERENCE[fp32] (tests/tolerances.py: the same function in fp32, products summed in
other orders); equality for what is only copied (the tensors of the round trip).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_models import VOCAB, deepseek_config, save_hf, transformers
from test_hf_parity import tokens, write_run
from tolerances import REFERENCE, assert_close

from dropless.hf import export_hf, import_hf, mapping

N_LAYERS, D = 3, 32  # deepseek_config()'s
MTP = f"model.layers.{N_LAYERS}."


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in import_hf.shard_files(folder) for k, v in load_file(f).items()}


def save_with_mtp(folder: Path, **kw) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny DeepSeek-V3 with one MTP layer added to its shards and index (module note); returns
    transformers' model (of the main layers) and the MTP tensors."""
    from safetensors.torch import save_file

    hf = save_hf(deepseek_config(**kw), folder)
    main = _tensors(folder)
    g = torch.Generator().manual_seed(11)
    mtp = {}
    for k, v in main.items():  # a whole MoE decoder layer, as transformers' layer 1
        if k.startswith("model.layers.1."):
            if k.endswith("norm.weight"):
                t = torch.rand(v.shape, generator=g) + 0.5
            elif k.endswith("e_score_correction_bias"):
                t = torch.randn(v.shape, generator=g) * 0.1
            else:
                t = torch.randn(v.shape, generator=g) * v.std()
            mtp[MTP + k[len("model.layers.1."):]] = t
    mtp.update({MTP + "enorm.weight": torch.rand(D, generator=g) + 0.5,
                MTP + "hnorm.weight": torch.rand(D, generator=g) + 0.5,
                MTP + "shared_head.norm.weight": torch.rand(D, generator=g) + 0.5,
                MTP + "eh_proj.weight": torch.randn(D, 2 * D, generator=g) * 0.1,
                MTP + "embed_tokens.weight": main["model.embed_tokens.weight"].clone(),
                MTP + "shared_head.head.weight": main["lm_head.weight"].clone()})
    save_file(mtp, str(folder / "mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((folder / import_hf.INDEX_FILE).read_text())
    index["weight_map"].update({k: "mtp.safetensors" for k in mtp})
    (folder / import_hf.INDEX_FILE).write_text(json.dumps(index))
    return hf, mtp


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp_logits(hf: torch.nn.Module, mtp: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP layer on transformers' main model: h = the main model's last hidden state
    (before its final norm), position t reads token t+1 (x[:, t+1]):
    z = eh_proj([enorm(embed(x[t+1])); hnorm(h[t])]), h' = decoder layer(z) (transformers' own
    DeepseekV3DecoderLayer holding the MTP tensors), logits = shared_head.head(shared_head.norm(h'))."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg, eps = hf.config, hf.config.rms_norm_eps
    seen = []
    hook = hf.model.norm.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    hf(x)
    hook.remove()
    B, S = x.shape
    n = S - 1
    e = _rms(mtp[MTP + "embed_tokens.weight"][x[:, 1:]], mtp[MTP + "enorm.weight"], eps)
    h = _rms(seen[0][:, :n], mtp[MTP + "hnorm.weight"], eps)
    z = torch.cat([e, h], dim=-1) @ mtp[MTP + "eh_proj.weight"].T
    layer = DeepseekV3DecoderLayer(cfg, layer_idx=N_LAYERS).eval()
    assert type(layer.mlp).__name__ == "DeepseekV3MoE"
    state = {k[len(MTP):]: v for k, v in mtp.items() if ".experts." not in k}
    E = cfg.n_routed_experts  # transformers 5 holds the experts fused: [E, 2F, D] rows [gate | up], [E, D, F]
    w = lambda e, name: mtp[f"{MTP}mlp.experts.{e}.{name}.weight"]  # noqa: E731
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w(e, "gate_proj"), w(e, "up_proj")]) for e in range(E)])
    state["mlp.experts.down_proj"] = torch.stack([w(e, "down_proj") for e in range(E)])
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not missing and set(unexpected) == {"enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight",
                                               "shared_head.norm.weight", "shared_head.head.weight"}
    pos = torch.arange(n)[None].expand(B, n)
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, n, n)
    out = layer(z, attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(z, pos))
    out = out[0] if isinstance(out, tuple) else out
    return _rms(out, mtp[MTP + "shared_head.norm.weight"], eps) @ mtp[MTP + "shared_head.head.weight"].T


def dropless_mtp_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's MTP module 1 as layers/mtp.py runs it in training (module k=1: position t reads
    token t+1), from the main model's last hidden state."""
    seen = []
    hook = model.norm.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    model(x)
    hook.remove()
    n, module = x.shape[1] - 1, model.mtp[0]
    h = module(seen[0][:, :n], model.embed(x[:, 1:]), model.rope_cos[:n], model.rope_sin[:n]).x
    return model.head(module.out_norm(h))


def test_import_maps_every_mtp_tensor_and_matches_deepseek(tmp_path: Path) -> None:
    """Every tensor of the checkpoint has a slot (none missing, none unexpected); the config gets one
    MoE-block MTP module; the main logits equal transformers'; the MTP module's logits equal
    DeepSeek's formula on transformers' layer."""
    hf, mtp = save_with_mtp(tmp_path)
    model, family = import_hf.load_model(tmp_path)
    assert (model.cfg.mtp_depth, model.cfg.mtp_block) == (1, "moe") and len(model.mtp_moe_layers()) == 1
    assert sorted(s.hf_name for s in mapping.slots(model, family)) == sorted(_tensors(tmp_path))
    bias = model.mtp[0].block.ffn.router.expert_bias
    assert torch.equal(bias, mtp[MTP + "mlp.gate.e_score_correction_bias"])
    x = tokens(seed=5)
    with torch.no_grad():
        assert_close(model(x).logits, hf(x).logits, REFERENCE[torch.float32], "deepseek_v3 main logits")
        want = reference_mtp_logits(hf, mtp, x)
        assert_close(dropless_mtp_logits(model, x), want, REFERENCE[torch.float32], "deepseek_v3 MTP logits")


def test_round_trip_writes_the_same_files_and_transformers_ignores_the_mtp_layer(tmp_path: Path) -> None:
    """Import, then export: the exported files hold exactly the input's tensors, bit for bit (the MTP
    layer with its embedding and head copies), and config.json declares the layer. transformers loads
    the export with no missing key and the same main logits; it ignores MTP layers by the name
    DeepSeek-V3's 61 layers give them (`model.layers.61.`), so at this depth it reports exactly the
    MTP layer's tensors as unexpected (each, the experts fused in its in-memory layout)."""
    src, run, out = tmp_path / "src", tmp_path / "run", tmp_path / "out"
    hf, mtp = save_with_mtp(src)
    model, _ = import_hf.load_model(src)
    write_run(model, run)
    export_hf.export(run, out, "deepseek_v3", max_shard_mb=0.01)
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert torch.equal(v, b[k]), k
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    unexpected = set(info["unexpected_keys"])  # (the experts under transformers 5's fused names)
    assert all(k.startswith(MTP) for k in unexpected)
    assert {k for k in unexpected if ".experts." not in k} == {k for k in mtp if ".experts." not in k}
    x = tokens(seed=6)
    with torch.no_grad():
        assert torch.equal(back.eval()(x).logits, hf(x).logits)


def test_mtp_layers_refused_by_name(tmp_path: Path) -> None:
    """A checkpoint holding some but not all declared MTP layers, or an MTP embedding that is not the
    main one, is refused naming the field or tensor; one holding none (what transformers saves with
    num_nextn_predict_layers=1) imports without MTP modules."""
    from safetensors.torch import save_file

    hf = save_hf(deepseek_config(), tmp_path / "plain", tokenizer=False)
    model, _ = import_hf.load_model(tmp_path / "plain")
    assert hf.config.num_nextn_predict_layers == 1 and model.cfg.mtp_depth == 0
    save_with_mtp(tmp_path / "two", num_nextn_predict_layers=2)
    with pytest.raises(ValueError, match=r"config\.json num_nextn_predict_layers=2: .*holds layers \[3\].*\[3, 4\]"):
        import_hf.load_model(tmp_path / "two")
    bad = tmp_path / "bad"
    _, mtp = save_with_mtp(bad)
    embed = mtp[MTP + "embed_tokens.weight"]
    embed[0, 0] += 1.0
    save_file(mtp, str(bad / "mtp.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.3\.embed_tokens\.weight .*not equal to embed\.weight"):
        import_hf.load_model(bad)
