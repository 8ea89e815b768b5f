"""A run's model for inference and export, LoRA runs included, and the fill of a LoRA run's base.

runs/load.py loads a run; a LoRA run's base may be a Hugging Face checkpoint (train.lora.base_from
"hf:DIR"), which only this package reads, so the loaders above (serve, check, bench, train) come
through here and hand runs/load.py the reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..config import LoRAConfig, ModelConfig, RunConfig
from ..distributed.materialize import Fill
from ..model import MoEModel
from ..runs import load as runs_load
from ..runs import lora_base
from . import import_hf


def base_fill(lora: LoRAConfig, progress: bool = False) -> Fill | None:
    """What fills a LoRA model's frozen base (runs/lora_base.py): None for the initial weights of the
    seed, else a loader of the run or the HF checkpoint `lora.base_from` names."""
    path = lora_base.base_path(lora)
    if path is None:
        return None
    if lora.base_from.startswith("run:"):
        return lora_base.RunBase(path)
    return import_hf.weight_loader(path, progress=progress)


def load_model(run_dir: str | Path, device: torch.device | str = "cpu",
               model_cfg: Callable[[ModelConfig], ModelConfig] | None = None) -> tuple[MoEModel, RunConfig]:
    """runs/load.py `load_model`, with the reader of an hf: LoRA base."""
    return runs_load.load_model(run_dir, device, model_cfg, hf_base=import_hf.weight_loader)
