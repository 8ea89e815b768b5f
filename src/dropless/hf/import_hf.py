"""`dropless import-hf DIR --out RUN_DIR`: a Hugging Face Qwen3-MoE, Mixtral or DeepSeek-V3 checkpoint as a dropless run.

    dropless import-hf DIR --out RUN_DIR [--set a.b=value ...]

DIR holds `config.json`, the weights (`model.safetensors`, or shards listed by
`model.safetensors.index.json`) and the tokenizer (`tokenizer.json`, with its companion files). The
run directory gets a step-0 checkpoint in the trainer's format, its `config.toml` (the model from
config.json via hf/mapping.py, where a key it omits takes transformers' default (hf/defaults.py);
`data.tokenizer="hf"`, fine-tuning defaults for the rest, `--set` overrides on top) and a copy of
the tokenizer files under `tokenizer/`; `dropless train --resume`, `generate`, `evaluate` and
`diagnose` take it as any run.

Streaming: the shards are read one tensor at a time through safetensors' memory map and copied
straight into the model's (fp32) parameters, the experts into their region of the stacked
[E, D, 2F] / [E, F, D] weights; nothing beyond one tensor is held besides the model itself. Every
tensor is checked against the shape config.json implies; a missing, unexpected, misshapen or
unreadable tensor, a missing shard or an inexpressible config field is a ValueError naming it, and
nothing is written (the run is assembled in a hidden folder and renamed into place at the end).
DeepSeek-V3: FP8 block-quantised weights are dequantised to fp32 as they are read (hf/fp8.py, the
scales read from whichever shard holds them); the multi-token-prediction layers (index >=
num_hidden_layers) become the model's MTP modules when the checkpoint holds them (the config reads
the checkpoint's tensor names for that: `checkpoint_config`, hf/deepseek.py); their copies of the
embedding and head (`Slot.copy`) are read again at the end and must equal the main tensors.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .. import atomic
from ..config import DataConfig, ModelConfig, RunConfig, apply_overrides, save_config, to_dict
from ..model import MoEModel
from . import fp8, mapping

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# copied with the tokenizer (whichever exist): what transformers' AutoTokenizer and generate read
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json", "chat_template.jinja")
# buffers some older checkpoints store (recomputed from the config by both libraries)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _safetensors() -> Any:
    try:
        import safetensors.torch  # noqa: F401
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError("dropless import-hf / export-hf need `safetensors`: pip install safetensors "
                          "(or pip install 'dropless[hf]')") from e
    return safe_open


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


def _tensors(path: Path, only: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a shard, one at a time; `only`: just that tensor, when it is there."""
    safe_open = _safetensors()
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if only is None or name == only:
                    yield name, f.get_tensor(name)
    except Exception as e:  # safetensors raises its own SafetensorError (truncated file, bad header)
        raise ValueError(f"{path}: cannot read safetensors file ({type(e).__name__}: {e})") from e


@torch.no_grad()
def load_weights(model: MoEModel, hf_dir: str | Path, family: str, progress: bool = False) -> None:
    """Fill `model` (built from the same config.json) from the checkpoint's shards (module note)."""
    tied = model.head.weight is model.embed.weight
    table = {s.hf_name: s for s in mapping.slots(model, family)}
    alternates = {s.hf_name: s for s in mapping.fused_slots(model, family)}
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    filled: dict[str, int] = defaultdict(int)
    seen: set[str] = set()
    unexpected: list[str] = []
    copies: list[tuple[str, Path, mapping.Slot]] = []
    block = fp8.block_size(read_config(hf_dir))
    files = shard_files(hf_dir)
    index = Path(hf_dir) / INDEX_FILE
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    bar = _progress(files, progress)
    for path in bar:
        for name, t in _tensors(path):
            slot = table.get(name) or alternates.get(name)
            if slot is None:
                if name.endswith(fp8.SCALE_SUFFIX) and block is not None:
                    pass  # read with its weight
                elif not (name == "lm_head.weight" and tied) and not name.endswith(IGNORED_SUFFIXES):
                    unexpected.append(name)
                continue
            if slot.copy:  # a second copy of a parameter another slot fills: compared at the end
                copies.append((name, path, slot))
                seen.add(name)
                continue
            if t.dtype in fp8.FP8_DTYPES and block is not None:
                t = fp8.dequantize(t, _scale_of(hf_dir, weight_map, name, path), block) if tuple(t.shape) == slot.shape else t
            elif t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"tensor {name} in {path.name}: dtype {t.dtype} is not supported "
                                 "(fp32, bf16, fp16, or float8_e4m3fn with block scales and a "
                                 "quantization_config in config.json)")
            if tuple(t.shape) != slot.shape:
                raise ValueError(f"tensor {name} in {path.name}: shape {tuple(t.shape)}, but config.json "
                                 f"implies {slot.shape}")
            p = params[slot.param]
            region = p[slot.index] if slot.index else p
            region.copy_(t.transpose(-1, -2) if slot.transpose else t)
            filled[slot.param] += t.numel()
            seen.add(name)
    if unexpected:
        raise ValueError(f"unexpected tensors (not part of a {family} model with this config.json): "
                         f"{', '.join(sorted(unexpected)[:8])}{' ...' if len(unexpected) > 8 else ''}")
    twice = [n for n, c in filled.items() if c > params[n].numel()]
    if twice:
        raise ValueError(f"the checkpoint holds some weights twice (per-expert and fused layouts?): {twice[:4]}")
    missing = [s.hf_name for s in table.values()
               if s.hf_name not in seen and (s.copy or filled[s.param] < params[s.param].numel())]
    if missing:
        raise ValueError(f"missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    for name, path, slot in copies:
        for _, t in _tensors(path, only=name):
            if tuple(t.shape) != slot.shape or not torch.equal(t.to(params[slot.param].dtype), params[slot.param]):
                raise ValueError(f"tensor {name} in {path.name}: not equal to {slot.param}'s tensor, which it "
                                 "repeats (dropless shares one embedding and one head with the MTP layers)")


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


def _scale_of(hf_dir: str | Path, weight_map: dict[str, str], name: str, path: Path) -> torch.Tensor:
    """The block scales of the FP8 weight `name` (read from `path`), from whichever shard the index
    puts them in (one tensor read through the memory map)."""
    scale = name + fp8.SCALE_SUFFIX
    where = Path(hf_dir) / weight_map.get(scale, path.name)
    for n, t in _tensors(where, only=scale):
        return t
    raise ValueError(f"tensor {name} in {path.name}: float8 weight without its {scale} "
                     f"(looked in {where.name})")


def _progress(items: list[Path], enabled: bool) -> Any:
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="shards", unit="shard", file=sys.stderr)


def load_model(hf_dir: str | Path, progress: bool = False) -> tuple[MoEModel, str]:
    """The dropless model of an HF checkpoint folder (fp32, CPU, eval mode) and its family."""
    cfg, family = checkpoint_config(hf_dir)  # (a missing weight file fails before the model is allocated)
    model = MoEModel(cfg)
    load_weights(model, hf_dir, family, progress)
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


def weight_loader(hf_dir: str | Path, progress: bool = False) -> Callable[[MoEModel], None]:
    """What the trainer calls on its freshly built model to fill it from the checkpoint."""
    family = read_config(hf_dir)["model_type"]
    return lambda model: load_weights(model, hf_dir, family, progress)


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
    model = MoEModel(cfg.model)  # (only balancing/compute fields of model. may differ from model_cfg)
    load_weights(model, hf_dir, family, progress)
    save_run(model, cfg, hf_dir, out, {"family": family})
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless import-hf",
                                description="Import a Hugging Face Qwen3-MoE, Mixtral or DeepSeek-V3 checkpoint as a run.")
    p.add_argument("hf_dir", metavar="DIR", help="folder with config.json, *.safetensors, tokenizer.json")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="the run directory to write")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value",
                   help="override a field of the run's config (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    try:
        cfg = write_run(args.hf_dir, args.out, args.overrides, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless import-hf: error: {err}", file=sys.stderr)
        return 2
    hf = read_config(args.hf_dir)
    print(f"imported {hf['model_type']} from {args.hf_dir} into {args.out}")
    print(describe_balancing(cfg.model, hf))
    return 0


if __name__ == "__main__":
    sys.exit(main())
