"""The frozen base of a LoRA run (train.lora): its checksum, and reading it from a dropless run.

A LoRA run's checkpoints hold the adapters, the trainable router weights when "router" is a target,
the buffers (the routers' expert bias) and the optimizer state: never the base (runs/dist_checkpoint.py).
The base is named by `train.lora.base_from` and rebuilt from it at every start:
    ""          the initial weights of train.seed (layers/init.py: a function of seed and name)
    "run:DIR"   a dropless run's latest checkpoint (a full run: a LoRA run is merged first,
                `dropless merge-lora`), read here one tensor at a time (runs/dcp_tensors.py)
    "hf:DIR"    a Hugging Face checkpoint, read by hf/import_hf.py (a level above: hf/load_run.py)
Each checkpoint records `base_digest` of what it was trained on; a resume or a load whose base digest
differs is refused by name (the adapters of one base applied to another are silently another model).

The digest is sha256 over the base's files (names and bytes: for hf:, the safetensors shards and
config.json; for run:, every file of the latest checkpoint), read once per start, with a progress bar.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..config import LoRAConfig
from ..layers import init
from ..layers import lora as lora_layers
from . import checkpoint as ckpt
from .dcp_tensors import open_tensors

CHUNK = 16 * 2**20


def base_path(lora: LoRAConfig) -> Path | None:
    return Path(lora.base_from.split(":", 1)[1]) if lora.base_from else None


def base_files(lora: LoRAConfig) -> list[Path]:
    """The files whose bytes are the base (module note); FileNotFoundError when there is none."""
    path = base_path(lora)
    if path is None:
        return []
    if lora.base_from.startswith("run:"):
        latest = ckpt.latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"train.lora.base_from={lora.base_from!r}: no complete checkpoint under "
                                    f"{path / ckpt.CHECKPOINT_DIR}")
        return sorted(p for p in latest.iterdir() if p.is_file())
    files = sorted(path.glob("*.safetensors")) + [path / "config.json"]
    missing = [str(p) for p in files if not p.is_file()]
    if missing or len(files) == 1:
        raise FileNotFoundError(f"train.lora.base_from={lora.base_from!r}: no safetensors weights and "
                                f"config.json there ({', '.join(missing) or 'no *.safetensors'})")
    return files


def base_digest(lora: LoRAConfig, seed: int, progress: bool = False) -> str:
    """"sha256:<hex>" of the base's files, or "seed:<seed>" for the initial weights (module note)."""
    if not lora.base_from:
        return f"seed:{seed}"
    files = base_files(lora)
    h = hashlib.sha256()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True,
                   desc="base checksum", leave=False)
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                if bar is not None:
                    bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return "sha256:" + h.hexdigest()


def check_digest(saved: str | None, current: str, where: str) -> None:
    """ValueError when a checkpoint's adapters were trained on another base than the one named now."""
    if saved is not None and saved != current:
        raise ValueError(f"{where}: its adapters were trained on base {saved}, but train.lora.base_from now "
                         f"gives {current}: the adapters of one base on another are another model")


class RunBase:
    """Fill a LoRA model's base from a dropless run's latest checkpoint (a `Fill`: each process
    writes the rows `where` says it holds). The adapters are left to their initial weights."""

    def __init__(self, run_dir: str | Path) -> None:
        latest = ckpt.latest_checkpoint(run_dir)
        if latest is None:
            raise FileNotFoundError(f"run:{run_dir}: no complete checkpoint under {Path(run_dir) / ckpt.CHECKPOINT_DIR}")
        self.path = latest

    def __call__(self, model: torch.nn.Module, where: init.Where = init.whole) -> None:
        from .dist_checkpoint import trainer_state

        saved = trainer_state(self.path).get("config", {})
        if saved.get("train", {}).get("lora", {}).get("rank", 0):
            raise ValueError(f"run:{self.path.parent.parent} is a LoRA run (its checkpoints hold adapters, no "
                             "base): merge it first (dropless merge-lora RUN --out RUN2) and name RUN2")
        tensors = open_tensors(self.path)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if lora_layers.is_adapter(name):
                    continue
                if name not in tensors.specs:
                    raise ValueError(f"run:{self.path.parent.parent}: its checkpoint has no {name!r} (another model)")
                part = where(name, p)
                full = tensors.read(name)
                part.tensor.copy_(full[part.start:part.start + part.tensor.shape[0]] if full.dim() else full)
            for name, b in model.named_buffers():
                if name in tensors.specs:
                    b.copy_(tensors.read(name))
