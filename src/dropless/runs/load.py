"""Load a trained run's model for inference: the latest complete checkpoint, all E experts on one
device, whatever world size wrote it.

A run directory written by `dropless quantize` (4-bit routed experts, runs/packed.py) loads the
same way: its config and a model whose MoE layers hold `PackedExperts`.

A LoRA run's checkpoint holds its adapters: the base is rebuilt from `train.lora.base_from` and its
digest checked against the one the run recorded (runs/lora_base.py) before the adapters load.

`model_cfg` (optional) maps the run's ModelConfig to the one to build (serving-time changes that keep
every parameter's shape, e.g. fewer experts per token); the checkpoint's tensors must still fit it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..config import ModelConfig, RunConfig, from_dict
from ..distributed.materialize import Fill
from ..layers import init
from ..layers.frozen_base import pack_frozen_base
from ..model import MoEModel
from . import checkpoint as ckpt
from . import lora_base, packed


def run_config(run_dir: str | Path) -> tuple[RunConfig, Path]:
    """The config stored with the run's latest complete checkpoint, and that checkpoint's path (for
    a packed run: its config and `quantized/` folder)."""
    if packed.is_packed_run(run_dir):
        return packed.packed_run_config(run_dir)
    path = ckpt.latest_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint under {Path(run_dir) / 'checkpoints'}")
    if ckpt.is_dcp_checkpoint(path):
        from . import dist_checkpoint

        return from_dict(RunConfig, dist_checkpoint.trainer_state(path)["config"]), path
    return from_dict(RunConfig, ckpt.load_checkpoint(path)["config"]), path


def load_model(run_dir: str | Path, device: torch.device | str = "cpu",
               model_cfg: Callable[[ModelConfig], ModelConfig] | None = None,
               hf_base: Callable[[Path], Fill] | None = None) -> tuple[MoEModel, RunConfig]:
    """The model of a run's latest checkpoint, on `device`, in eval mode, with all E experts, from a
    DCP checkpoint of any world size or an older one-process `state.pt`. A LoRA run's model is its
    base (train.lora.base_from, runs/lora_base.py; `hf_base` reads an hf: base, hf/load_run.py) with
    the checkpoint's adapters, its base digest checked."""
    cfg, path = run_config(run_dir)
    if model_cfg is not None:
        cfg.model = model_cfg(cfg.model)  # a new ModelConfig validates itself on construction
    if packed.is_packed_run(run_dir):
        return packed.load_packed(run_dir, cfg, device), cfg
    lora = cfg.train.lora if cfg.train.lora.enabled else None
    with torch.device("meta"):  # allocated once, on `device`, and filled from the checkpoint alone
        model = MoEModel(cfg.model, lora=lora)
    model.materialize(device)
    if lora is not None:
        fill_lora_base(model, cfg, path, hf_base)
    if ckpt.is_dcp_checkpoint(path):
        from . import dist_checkpoint

        dist_checkpoint.load_full_model(path, model)
    else:
        model.load_state_dict(ckpt.load_checkpoint(path)["model"])
    if lora is not None:  # QLoRA: packed as it trained (layers/frozen_base.py), after the adapters loaded
        pack_frozen_base(model, lora.base)
    model.eval()
    return model, cfg


def fill_lora_base(model: MoEModel, cfg: RunConfig, path: Path, hf_base: Callable[[Path], Fill] | None) -> None:
    """A LoRA model's frozen base, from train.lora.base_from, after checking its digest against the one
    checkpoint `path` was trained on."""
    from .dist_checkpoint import trainer_state

    lora = cfg.train.lora
    lora_base.check_digest(trainer_state(path).get("lora_base"), lora_base.base_digest(lora, cfg.train.seed),
                           f"{path}")
    base = lora_base.base_path(lora)
    with torch.no_grad():
        if base is None:
            model.init_weights(cfg.train.seed)
        elif lora.base_from.startswith("run:"):
            lora_base.RunBase(base)(model, init.whole)
        elif hf_base is None:
            raise ValueError(f"train.lora.base_from={lora.base_from!r}: an hf: base is read by hf/load_run.py "
                             "(load the run through it)")
        else:
            hf_base(base)(model, init.whole)
