"""`dropless merge-lora RUN --out RUN2`: a LoRA run's adapters merged into its base, as a full run.

    dropless merge-lora RUN --out RUN2

RUN2 is an ordinary run: its config is RUN's with `train.lora` off, its checkpoint (at RUN's step) the
merged weights and no optimizer state (a resume of RUN2 starts a fresh optimizer, as an imported run
does), and its tokenizer RUN's (the folder of data.tokenizer_path is referenced as before).
`export-hf`, `generate`, `evaluate`, `quantize` and another LoRA run (`train.lora.base_from=run:RUN2`)
take it as they take any run.

What merging computes, in fp32, per adapted weight (layers/lora.py):
    LoRALinear      W + s B A
    routed experts  w1 + s a1 b1 and w2 + s a2 b2 per expert (the one place an [E, D, W] update is
                    formed: here, once, never in training)
A base held packed (train.lora.base = fp8 | mxfp4 | nvfp4, or bf16) is the dequantised weights the
adapters trained against, so the merged model computes what the adapted model computed; its weights
are then full precision (4 bytes each) and no longer packed.

It lives in hf/ because a LoRA run's base may be a Hugging Face checkpoint (hf/load_run.py).
RUN2 is assembled hidden and renamed into place: nothing is left on an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from .. import atomic
from ..config import LoRAConfig, RunConfig, save_config, to_dict
from ..layers import lora as lora_layers
from ..model import MoEModel
from ..runs import checkpoint as ckpt
from ..runs import dist_checkpoint
from .load_run import load_model


def merged_state(model: MoEModel) -> dict[str, torch.Tensor]:
    """The state dict of the plain model (no adapters) that computes what adapted `model` computes."""
    out: dict[str, torch.Tensor] = {}
    merged_names: set[str] = set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, lora_layers.LoRALinear):
            out[prefix + "weight"] = module.merged_weight()
            merged_names.add(prefix + "weight")
        elif lora_layers.has_expert_adapters(module):
            w1, w2 = lora_layers.merged_expert_weights(module)
            out[prefix + "w_gate_up_EDF"], out[prefix + "w_down_EFD"] = w1, w2
        elif getattr(module, "dequant_base", None) is not None:  # frozen experts without adapters
            # (outside train.lora.layers, an MTP block's, or targets without "experts"): a packed
            # stack is buffers the state dict does not hold, so its values come from the reader
            w1, w2 = module.dequant_base(torch.float32)()
            out[prefix + "w_gate_up_EDF"], out[prefix + "w_down_EFD"] = w1, w2
    for name, t in model.state_dict().items():
        if name not in out and not lora_layers.is_adapter(name):
            out[name] = t.float() if t.is_floating_point() else t
    return out


def merge(run_dir: str | Path, out: str | Path) -> RunConfig:
    """Merge RUN's adapters (module note); returns RUN2's config."""
    run_dir, out = Path(run_dir), Path(out).absolute()
    atomic.require_empty_dir(out)
    model, cfg = load_model(run_dir, "cpu")
    if model.lora is None:
        raise ValueError(f"{run_dir}: train.lora.rank=0, not a LoRA run (nothing to merge)")
    state = merged_state(model)
    new_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lora=LoRAConfig()))
    with torch.device("meta"):
        plain = MoEModel(new_cfg.model)
    plain.materialize("cpu")
    plain.load_state_dict(state, strict=True)
    del model
    path = ckpt.latest_checkpoint(run_dir)
    step = int(dist_checkpoint.trainer_state(path)["step"])
    with atomic.build_dir(out) as tmp:
        saved = {"step": step, "rng": ckpt.rng_state(), "config": to_dict(new_cfg), "world_size": 1,
                 "optimizer_state": False, "merged_from": str(run_dir.absolute()),
                 "lora_base_from": cfg.train.lora.base_from}
        dist_checkpoint.save(tmp, step, plain, None, saved)
        save_config(new_cfg, tmp / "config.toml")
        if (run_dir / "tokenizer").is_dir():  # an imported run's copy travels with it
            import shutil

            shutil.copytree(run_dir / "tokenizer", tmp / "tokenizer")
    return new_cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless merge-lora", description="Merge a LoRA run's adapters "
                                "into its base: a full run.")
    p.add_argument("run_dir", help="the LoRA run")
    p.add_argument("--out", required=True, help="the merged run's folder (absent or empty)")
    args = p.parse_args(argv)
    try:
        merge(args.run_dir, args.out)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless merge-lora: error: {err}", file=sys.stderr)
        return 2
    print(f"merged run: {Path(args.out).absolute()}")
    return 0
