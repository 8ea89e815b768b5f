"""The packed-experts run directory: a trained model whose routed experts are stored in 4 bits.

Layout (written by `dropless quantize`, read by `serve.load.load_model`):

    RUN_DIR2/config.toml               the source checkpoint's RunConfig (unchanged)
    RUN_DIR2/quantized/manifest.json   {"format": "dropless-packed-experts", "version": 1,
                                        "experts": "mxfp4" | "nvfp4", "source_run", "source_step",
                                        "config": {...}, "tensors": "model.pt", "bytes": {...}}
    RUN_DIR2/quantized/model.pt        torch.save of the packed model's state dict

The state dict is the original model's, tensor for tensor (attention, router, embeddings, norms,
dense layers and shared experts as the checkpoint stored them), except that every MoE layer's
`experts.w_gate_up_EDF` / `experts.w_down_EFD` are replaced by `PackedExperts`' buffers (codes, block
scales and NVFP4 tensor scales; layers/packed_experts.py). There is no `checkpoints/` folder, so the
trainer cannot mistake the directory for one it can resume: a packed model is for inference only.

Writing is atomic: everything goes into a hidden sibling folder that is renamed to RUN_DIR2 at the
end, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .. import atomic
from ..config import ModelConfig, RunConfig, from_dict, save_config, to_dict
from ..layers.moe import MoELayer
from ..layers.packed_experts import PackedExperts, check_packable
from ..model import MoEModel

FORMAT = "dropless-packed-experts"
VERSION = 1
QUANT_DIR = "quantized"
MANIFEST = "manifest.json"
TENSORS = "model.pt"


def is_packed_run(run_dir: str | Path) -> bool:
    return (Path(run_dir) / QUANT_DIR / MANIFEST).is_file()


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / QUANT_DIR / MANIFEST
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path}: format={manifest.get('format')!r} version={manifest.get('version')!r}; "
                         f"this dropless reads {FORMAT!r} version {VERSION}")
    if manifest.get("experts") not in ("mxfp4", "nvfp4"):
        raise ValueError(f"{path}: experts={manifest.get('experts')!r} is not a known 4-bit format")
    return manifest


def packed_run_config(run_dir: str | Path) -> tuple[RunConfig, Path]:
    """The RunConfig a packed run was quantised from, and its `quantized/` folder."""
    return from_dict(RunConfig, read_manifest(run_dir)["config"]), Path(run_dir) / QUANT_DIR


def expert_shape(layer: MoELayer) -> tuple[int, int, int]:
    """(E, D, F) of a built MoE layer's routed experts, from their weights: D is the width of the rows
    they read (the latent width under LatentMoE), F the expert width."""
    E, D, _ = layer.experts.w_gate_up_EDF.shape
    return E, D, layer.experts.w_down_EFD.shape[1]


def check_model_packable(model: MoEModel, fmt: str) -> None:
    """ValueError unless every MoE layer's expert widths (as built) are whole blocks of `fmt`."""
    for layer in model.moe_layers():
        _, D, F = expert_shape(layer)
        check_packable(fmt, D, F, "model.moe.latent_dim" if layer.latent is not None else "model.d_model")


def pack_model(model: MoEModel, fmt: str) -> MoEModel:
    """Replace every MoE layer's GroupedExperts by a PackedExperts holding its 4-bit weights, in
    place (the fp32 expert weights are released); the model is put in eval mode."""
    check_model_packable(model, fmt)
    for layer in model.moe_layers():
        layer.experts = PackedExperts.from_experts(layer.experts, fmt)
    return model.eval()


def meta_model(cfg: ModelConfig) -> MoEModel:
    """The model of `cfg` built on the meta device: every module and shape, nothing allocated."""
    with torch.device("meta"):
        return MoEModel(cfg)


def packed_skeleton(cfg: ModelConfig, fmt: str, device: torch.device | str = "cpu") -> MoEModel:
    """A model of `cfg` on `device` whose MoE layers hold PackedExperts of `fmt` shaped like the experts
    the model builds, every tensor allocated but not initialised: for load_state_dict to fill. Built
    on the meta device, so the full-precision experts are never allocated."""
    model = meta_model(cfg)
    check_model_packable(model, fmt)
    for layer in model.moe_layers():
        old = layer.experts
        with torch.device("meta"):
            layer.experts = PackedExperts(*expert_shape(layer), fmt, old.kind, old.clamp, old.softcap,
                                          old.backend, old.precision)
    return model.materialize(device)


def load_packed(run_dir: str | Path, cfg: RunConfig, device: torch.device | str = "cpu") -> MoEModel:
    """The packed model of a `dropless quantize` output, on `device`, in eval mode. `cfg` may differ
    from the stored one in serving-time fields (e.g. top_k) as long as every tensor still fits."""
    manifest = read_manifest(run_dir)
    model = packed_skeleton(cfg.model, manifest["experts"])
    state = torch.load(Path(run_dir) / QUANT_DIR / manifest["tensors"], map_location="cpu",
                       weights_only=True)
    model.load_state_dict(state)  # strict: every tensor the skeleton left uninitialised is in the file
    return model.to(device).eval()


def state_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of distinct storages (a tied embedding / LM head counts once)."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        seen[(t.untyped_storage().data_ptr(), t.device.index or 0)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def model_bytes(model: MoEModel) -> dict[str, int]:
    """In-memory bytes of the model's state: total, and the routed experts' share."""
    tensors = list(model.state_dict().values())
    experts = [t for layer in model.moe_layers() for t in layer.experts.state_dict().values()]
    return {"total": state_bytes(tensors), "experts": state_bytes(experts)}


def save_packed(model: MoEModel, cfg: RunConfig, out: str | Path, fmt: str, source_run: str | Path,
                source_step: int) -> Path:
    """Write a packed model (from `pack_model`) as the run directory `out` (absent or empty)."""
    out = Path(out)
    atomic.require_empty_dir(out, "--out")
    with atomic.build_dir(out) as tmp:
        (tmp / QUANT_DIR).mkdir()
        save_config(cfg, tmp / "config.toml")
        torch.save(model.state_dict(), tmp / QUANT_DIR / TENSORS)
        manifest = {
            "format": FORMAT, "version": VERSION, "experts": fmt,
            "source_run": str(Path(source_run).resolve()), "source_step": source_step,
            "tensors": TENSORS, "bytes": {**model_bytes(model),
                                          "file": (tmp / QUANT_DIR / TENSORS).stat().st_size},
            "config": to_dict(cfg),
        }
        (tmp / QUANT_DIR / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out
