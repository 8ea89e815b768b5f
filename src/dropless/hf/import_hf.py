"""`dropless import-hf DIR --out RUN_DIR`: a Hugging Face Qwen3-MoE, Mixtral or DeepSeek-V3 checkpoint as a dropless run.

    dropless import-hf DIR --out RUN_DIR [--nproc N] [--set a.b=value ...]

DIR holds `config.json`, the weights (`model.safetensors`, or shards listed by
`model.safetensors.index.json`) and the tokenizer (`tokenizer.json`, with its companion files). The
run directory gets a step-0 checkpoint in the trainer's format, its `config.toml` (the model from
config.json via hf/mapping.py, where a key it omits takes transformers' default (hf/defaults.py);
`data.tokenizer="hf"`, fine-tuning defaults for the rest, `--set` overrides on top) and a copy of
the tokenizer files under `tokenizer/`; `dropless train --resume`, `generate`, `evaluate` and
`diagnose` take it as any run.

Loading (hf/shard_load.py): the model is built on the meta device and allocated without initial
weights; each tensor is read through safetensors' memory map and copied straight into its region of
the model's (fp32) parameters, the experts into their rows of the stacked [E, D, 2F] / [E, F, D]
weights; nothing beyond one tensor is held besides the model itself. `--nproc N` imports at world N
(hf/import_cli.py): each process holds and reads only its own shards. Every tensor is checked
against the shape config.json implies; a missing, unexpected, misshapen or unreadable tensor, a
missing shard or an inexpressible config field is a ValueError naming it, and nothing is written
(the run is assembled in a hidden folder and renamed into place at the end). DeepSeek-V3: FP8
block-quantised weights are dequantised to fp32 as they are read (hf/fp8.py, the scales read from
whichever shard holds them); the multi-token-prediction layers (index >= num_hidden_layers) become
the model's MTP modules when the checkpoint holds them (the config reads the checkpoint's tensor
names for that: `checkpoint_config`, hf/deepseek.py); their copies of the embedding and head
(`Slot.copy`) must equal the main tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from .. import atomic
from ..config import DataConfig, ModelConfig, RunConfig, apply_overrides, save_config, to_dict
from ..distributed.materialize import build_model
from ..layers import init
from ..model import MoEModel
from . import fp8, mapping, shard_load

INDEX_FILE = shard_load.INDEX_FILE
SINGLE_FILE = "model.safetensors"
# copied with the tokenizer (whichever exist): what transformers' AutoTokenizer and generate read
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json", "chat_template.jinja")


def _safetensors() -> Any:
    return shard_load.safe_open()


def read_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{hf_dir}: no config.json (not a Hugging Face model folder)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def shard_files(hf_dir: str | Path) -> list[Path]:
    """The weight files: the shards the index names (each must exist), or the single file."""
    d = Path(hf_dir)
    if (d / INDEX_FILE).is_file():
        weight_map = json.loads((d / INDEX_FILE).read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise ValueError(f"{d / INDEX_FILE} names shards that are missing: {', '.join(missing)}")
        return [d / f for f in files]
    if (d / SINGLE_FILE).is_file():
        return [d / SINGLE_FILE]
    raise ValueError(f"{d}: no {SINGLE_FILE} and no {INDEX_FILE}")


def load_weights(model: MoEModel, hf_dir: str | Path, family: str, progress: bool = False,
                 where: init.Where = init.whole) -> shard_load.LoadStats:
    """Fill `model` (built from the same config.json, materialised; possibly sharded: `where` says
    which rows of each parameter this process holds) from the checkpoint (hf/shard_load.py)."""
    return shard_load.load_local(model, hf_dir, family, shard_files(hf_dir), fp8.block_size(read_config(hf_dir)),
                                 where, progress)


def tensor_names(hf_dir: str | Path) -> list[str]:
    """The checkpoint's tensor names: the index's, or the single file's header (every shard the
    index names must exist)."""
    files, index = shard_files(hf_dir), Path(hf_dir) / INDEX_FILE
    if index.is_file():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    with _safetensors()(str(files[0]), framework="pt") as f:
        return list(f.keys())


def checkpoint_config(hf_dir: str | Path) -> tuple[ModelConfig, str]:
    """mapping.model_config of the folder's config.json and tensor names (DeepSeek-V3's MTP layers
    are the model's when the checkpoint holds them)."""
    return mapping.model_config(read_config(hf_dir), tensor_names(hf_dir))


class WeightLoader:
    """What the trainer calls on its freshly materialised (possibly sharded) model to fill it from
    the checkpoint; `bytes_read` then says how much this process read."""

    def __init__(self, hf_dir: str | Path, progress: bool = False) -> None:
        self.hf_dir, self.progress = Path(hf_dir), progress
        self.family = read_config(hf_dir)["model_type"]
        self.stats: shard_load.LoadStats | None = None

    @property
    def bytes_read(self) -> int | None:
        return None if self.stats is None else self.stats.bytes_read

    def __call__(self, model: MoEModel, where: init.Where = init.whole) -> None:
        self.stats = load_weights(model, self.hf_dir, self.family, self.progress, where)


def load_model(hf_dir: str | Path, progress: bool = False) -> tuple[MoEModel, str]:
    """The dropless model of an HF checkpoint folder (fp32, CPU, eval mode) and its family: built on
    the meta device and filled straight from the files (no initial weights drawn)."""
    cfg, family = checkpoint_config(hf_dir)  # (a missing weight file fails before the model is allocated)
    model, _, _ = build_model(cfg, torch.device("cpu"), 0, fill=WeightLoader(hf_dir, progress))
    return model.eval(), family


def run_config(model_cfg: ModelConfig, tokenizer_path: str | Path, overrides: list[str],
               base: RunConfig | None = None) -> RunConfig:
    """The run config of an imported model: `base` (default: the defaults, with a fine-tuning
    learning rate) with the HF model and tokenizer, sequences no longer than the model's positions,
    then the dotted overrides."""
    base = base or apply_overrides(RunConfig(), ["train.lr=1e-5", "train.warmup_steps=0"])
    train = base.train
    train.seq_len = min(train.seq_len, model_cfg.max_seq_len)
    data = DataConfig(**{**vars(base.data), "tokenizer": "hf", "tokenizer_path": str(tokenizer_path)})
    cfg = RunConfig(model=model_cfg, train=train, data=data, log=base.log, parallel=base.parallel)
    return apply_overrides(cfg, overrides)


def init_config(hf_dir: str | Path, base: RunConfig, overrides: list[str]) -> RunConfig:
    """`dropless train --init-from hf:DIR`: the run config (`base` = the preset, with the checkpoint's
    model and its tokenizer.json in place), checked before any weight is read."""
    hf_dir = Path(hf_dir)
    model_cfg, _ = checkpoint_config(hf_dir)
    if not (hf_dir / "tokenizer.json").is_file():
        raise ValueError(f"--init-from hf:{hf_dir}: no tokenizer.json (the run trains with the checkpoint's "
                         "own tokenizer)")
    return run_config(model_cfg, (hf_dir / "tokenizer.json").absolute(), overrides, base)


def weight_loader(hf_dir: str | Path, progress: bool = False) -> WeightLoader:
    """What the trainer calls on its freshly built model to fill it from the checkpoint."""
    return WeightLoader(hf_dir, progress)


def describe_balancing(cfg: ModelConfig, hf: dict[str, Any]) -> str:
    """The balancing rule a fine-tune of this model (from config.json `hf`) trains with, in words,
    for the run log: the family's rule (hf/mapping.py), or what --set changed it to."""
    family, default = hf["model_type"], mapping.model_config(hf)[0].moe.balance
    b, K, L = cfg.moe.balance, cfg.moe.top_k, cfg.n_moe_layers
    rules = []
    if b.aux_loss_coeff > 0:
        why = (f"{family}'s rule: router_aux_loss_coef x top_k {K} / {L} MoE layers, transformers' loss "
               "scale" if b.aux_loss_coeff == default.aux_loss_coeff else
               f"set by --set; {family}'s rule gives {default.aux_loss_coeff:.4g}")
        rules.append(f"aux loss per MoE layer, coefficient {b.aux_loss_coeff:.4g} ({why})")
    if b.seq_aux_loss_coeff > 0:
        rules.append(f"sequence aux loss {b.seq_aux_loss_coeff:.4g}")
    if b.global_aux_loss_coeff > 0:
        rules.append(f"global-batch aux loss {b.global_aux_loss_coeff:.4g}")
    if b.z_loss_coeff > 0:
        rules.append(f"z-loss {b.z_loss_coeff:.4g}")
    if b.bias_update_rate > 0:
        why = (f"{family}'s rule" if b.bias_update_rate == default.bias_update_rate else "set by --set")
        rules.append(f"loss-free expert-bias balancing, step {b.bias_update_rate:.4g} per optimizer step ({why})")
    if b.quantile_balance:
        rules.append("quantile expert-bias balancing")
    return "balancing: " + ("; ".join(rules) if rules else "NONE (every balancing coefficient is 0)")


def copy_tokenizer(hf_dir: Path, dest: Path) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    copied = [n for n in TOKENIZER_FILES if (hf_dir / n).is_file()]
    for n in copied:
        shutil.copy2(hf_dir / n, dest / n)
    return copied


def check_out(hf_dir: Path, out: Path, overrides: list[str]) -> None:
    """What write_run (and upcycle) refuse before reading any weight."""
    from ..fixed_fields import is_fixed

    for o in overrides:
        name = o.split("=", 1)[0].strip()
        if is_fixed(name):  # the checkpoint written must be the model config.json describes
            raise ValueError(f"--set {o}: {name} comes from config.json and the imported weights; "
                             "change it in a new run (dropless train --init-from hf:DIR --set ...)")
    atomic.require_empty_dir(out, "--out")
    if not (hf_dir / "tokenizer.json").is_file():
        raise ValueError(f"{hf_dir}: no tokenizer.json (the run trains and generates with the "
                         "checkpoint's own tokenizer)")


def save_run(model: MoEModel, cfg: RunConfig, hf_dir: Path, out: Path, extra: dict[str, Any]) -> None:
    """Write `model` as the step-0 checkpoint of the run directory `out` with its config.toml and
    the checkpoint's tokenizer files, assembled hidden and renamed into place (nothing left on error)."""
    from ..runs import checkpoint as ckpt
    from ..runs import dist_checkpoint

    with atomic.build_dir(out) as tmp:
        copy_tokenizer(hf_dir, tmp / "tokenizer")
        from ..data.tokenizer import HFTokenizer

        vocab = HFTokenizer(tmp / "tokenizer").vocab_size
        if vocab > cfg.model.vocab_size:
            raise ValueError(f"tokenizer.json: {vocab} tokens, more than config.json vocab_size="
                             f"{cfg.model.vocab_size}")
        # the model alone: the optimizer a resume builds starts fresh (what a zero state at step 0 is)
        state = {"step": 0, "rng": ckpt.rng_state(), "config": to_dict(cfg), "world_size": 1,
                 "imported_from": str(hf_dir.absolute()), "optimizer_state": False, **extra}
        dist_checkpoint.save(tmp, 0, model, None, state)
        save_config(cfg, tmp / "config.toml")


def write_run(hf_dir: str | Path, out: str | Path, overrides: list[str] | None = None,
              progress: bool = False) -> RunConfig:
    """Import `hf_dir` as the run directory `out` (module note); returns its config."""
    hf_dir, out = Path(hf_dir), Path(out).absolute()
    check_out(hf_dir, out, overrides or [])
    model_cfg, family = checkpoint_config(hf_dir)
    cfg = run_config(model_cfg, out / "tokenizer" / "tokenizer.json", overrides or [])  # fails before loading
    # (only balancing/compute fields of model. may differ from model_cfg)
    model, _, _ = build_model(cfg.model, torch.device("cpu"), 0, fill=WeightLoader(hf_dir, progress))
    save_run(model, cfg, hf_dir, out, {"family": family})
    return cfg
