"""Load a trained run's model for inference: the latest complete checkpoint, all E experts on one
device, whatever world size wrote it.

A run directory written by `dropless quantize` (4-bit routed experts, runs/packed.py) loads the
same way: its config and a model whose MoE layers hold `PackedExperts`.

`model_cfg` (optional) maps the run's ModelConfig to the one to build (serving-time changes that keep
every parameter's shape, e.g. fewer experts per token); the checkpoint's tensors must still fit it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..config import ModelConfig, RunConfig, from_dict
from ..model import MoEModel
from . import checkpoint as ckpt
from . import packed


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
               ) -> tuple[MoEModel, RunConfig]:
    """The model of a run's latest checkpoint, on `device`, in eval mode, with all E experts, from a
    DCP checkpoint of any world size or an older one-process `state.pt`."""
    cfg, path = run_config(run_dir)
    if model_cfg is not None:
        cfg.model = model_cfg(cfg.model)  # a new ModelConfig validates itself on construction
    if packed.is_packed_run(run_dir):
        return packed.load_packed(run_dir, cfg, device), cfg
    with torch.device("meta"):  # allocated once, on `device`, and filled from the checkpoint alone
        model = MoEModel(cfg.model)
    model.materialize(device)
    if ckpt.is_dcp_checkpoint(path):
        from . import dist_checkpoint

        dist_checkpoint.load_full_model(path, model)
    else:
        model.load_state_dict(ckpt.load_checkpoint(path)["model"])
    model.eval()
    return model, cfg
