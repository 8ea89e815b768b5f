"""`dropless export-hf RUN_DIR --out DIR --family qwen3_moe|mixtral|deepseek_v3`: a run as a Hugging Face checkpoint.

    dropless export-hf RUN_DIR --out DIR --family qwen3_moe|mixtral|deepseek_v3 [--dtype fp32|bf16]
                       [--max-shard-size-mb N] [--no-progress] [--adapters-only]

Writes `config.json`, the weights as safetensors shards of at most N MiB with
`model.safetensors.index.json` (one `model.safetensors` when they fit in one), and the run's tokenizer
files (those `import-hf` copied, or the folder of `data.tokenizer_path`), so that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads it with no missing or unexpected keys.
config.json spells the rotary both as transformers 4.x reads it (`rope_theta`, `rope_scaling`) and as
5.x does (`rope_parameters`), so every version the `hf` extra allows computes the same model (hf/rope.py).
The names and layouts are hf/mapping.py's table read backwards: the per-expert layout that
`save_pretrained` writes. A dropless config the family cannot express (sigmoid scores, group-limited
routing, an expert bias, shared experts, ...) is a ValueError naming the field, before anything is
written; the folder is assembled hidden and renamed into place at the end.

A LoRA run (train.lora) holds adapters and no base: `--adapters-only` writes them as a peft adapter
folder (hf/peft_export.py); without it the export refuses and names both ways (that, or merge-lora
first, whose merged run exports as any run).

Multi-token prediction modules (`model.mtp_depth` > 0, layers/mtp.py): with MoE blocks
(`model.mtp_block = "moe"`) a deepseek_v3 export writes them as DeepSeek-V3's MTP layers after the
main ones, with `num_nextn_predict_layers` (hf/deepseek.py; transformers ignores them on load).
Otherwise they are left out, with a note on stderr: they only add a training loss, evaluation and
generation never run them, so the exported model computes the same logits without them (as
DeepSeek-V3's own inference drops its MTP layer). No family has a place for a dense MTP block, and
DeepSeek-V3's export writes num_nextn_predict_layers 0 then.

Streaming, from the checkpoint itself: the model is never built. Its structure and shapes come from the
model on the meta device (`mapping.meta_model`, `mapping.slots`); the checkpoint's metadata says each
stored tensor's global shape and dtype, checked against it before anything is written (a ValueError
naming the tensor). DCP checkpoints of any world size and expert-parallel size are read in this one
process without a process group, one dropless parameter at a time (runs/dcp_tensors.py): the routed
experts come back at their global [E, ...] shape whichever ranks held them.

The HF tensors are ordered so that all slots of one dropless parameter are consecutive (every
expert's gate and up halves of `w_gate_up_EDF`, then every expert's down), huggingface_hub's
`split_torch_state_dict_into_shards` plans the shards from their shapes alone, and each shard is
filled by reading each parameter it needs once (only the current one is kept), cutting its HF
tensors out (cast to the output dtype, contiguous), written with safetensors, and dropped. Peak
memory: one output shard plus one parameter (runs/dcp_tensors.py reads a one-piece parameter
without a second copy; the command runs on glibc's default allocator: cli.py). A parameter whose slots straddle a shard boundary stays cached into the next shard;
it is read again only when huggingface_hub puts one of its slots, larger than the shard size, in a
shard of its own out of order. An older one-process `state.pt` checkpoint is loaded whole (its
pickle cannot be read a piece at a time) and written the same way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from .. import atomic
from ..model import MoEModel
from ..runs.dcp_tensors import Tensors, TensorSpec, check, open_tensors
from . import mapping
from .optional import require
from .import_hf import INDEX_FILE, TOKENIZER_FILES, _safetensors
from .shard_load import progress_bar

DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}


def _split() -> Any:
    return require("huggingface_hub", "dropless export-hf", "split_torch_state_dict_into_shards")


def by_parameter(table: list[mapping.Slot]) -> list[mapping.Slot]:
    """The slots with all of one parameter's consecutive (parameters in order of first appearance,
    the table's order within one), so that a shard reads each parameter once (module note)."""
    first: dict[str, int] = {}
    for s in table:
        first.setdefault(s.param, len(first))
    return sorted(table, key=lambda s: first[s.param])  # (stable)


def expected_specs(model: MoEModel, table: list[mapping.Slot]) -> dict[str, TensorSpec]:
    """The shape and dtype of every parameter (or buffer) the slots read, from the (meta) model."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {p: TensorSpec(tuple(tensors[p].shape), tensors[p].dtype) for p in dict.fromkeys(s.param for s in table)}


def hf_tensor(param: torch.Tensor, slot: mapping.Slot, dtype: torch.dtype) -> torch.Tensor:
    """The HF tensor of `slot`: a fresh contiguous CPU copy of its region of the dropless parameter,
    cast to `dtype` (one allocation: the cast and the transpose happen in the copy)."""
    region = param[slot.index] if slot.index else param
    t = region.transpose(-1, -2) if slot.transpose else region
    return torch.empty(t.shape, dtype=dtype).copy_(t)


def write_shards(tensors: Tensors, table: list[mapping.Slot], dtype: torch.dtype, folder: Path,
                 max_shard_bytes: int, progress: bool = False) -> list[str]:
    """Write the slots' HF tensors, read from `tensors`, as safetensors shards of at most
    `max_shard_bytes` (a larger tensor gets a shard of its own) and, when there are several, the
    index; returns the file names.

    huggingface_hub plans the shards (sizes, file names, the index) from meta placeholders of the
    output shapes and dtype; each shard is then filled from one parameter at a time, written and
    dropped (module note). Its `save_torch_state_dict` is not used: it takes the whole state dict at
    once."""
    split = _split()
    _safetensors()
    from safetensors.torch import save_file

    slots = {s.hf_name: s for s in by_parameter(table)}
    plan = split({n: torch.empty(s.shape, dtype=dtype, device="meta") for n, s in slots.items()},
                 max_shard_size=max_shard_bytes)
    name: str | None = None
    param: torch.Tensor | None = None  # the one parameter held: `name`
    for filename in progress_bar(list(plan.filename_to_tensors), progress):
        shard = {}
        for n in plan.filename_to_tensors[filename]:
            s = slots[n]
            if s.param != name:
                param = None  # dropped before the next one is read
                param, name = tensors.read(s.param), s.param
            shard[n] = hf_tensor(param, s, dtype)
        save_file(shard, str(folder / filename), metadata={"format": "pt"})
        del shard
    files = list(plan.filename_to_tensors)
    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def tokenizer_folder(tokenizer: str, tokenizer_path: str | None) -> Path | None:
    if tokenizer != "hf" or not tokenizer_path:
        return None
    p = Path(tokenizer_path)
    return p if p.is_dir() else p.parent


def export(run_dir: str | Path, out: str | Path, family: str, dtype: str = "fp32",
           max_shard_mb: float = 5000.0, progress: bool = False, adapters_only: bool = False) -> list[str]:
    """Export the latest checkpoint of `run_dir` (module note), or a LoRA run's adapters alone
    (`adapters_only`, hf/peft_export.py); returns the files written."""
    from ..runs.load import run_config

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if not max_shard_mb > 0:
        raise ValueError(f"--max-shard-size-mb {max_shard_mb}: must be > 0")
    out = Path(out).absolute()
    atomic.require_empty_dir(out, "--out")
    from ..runs import packed

    if packed.is_packed_run(run_dir):
        raise ValueError(f"{run_dir}: a quantized run (4-bit experts); export the run it was quantized from")
    torch_dtype, name = DTYPES[dtype]
    if adapters_only:
        from .peft_export import export_adapters

        return export_adapters(run_dir, out, family, torch_dtype, progress)
    cfg, path = run_config(run_dir)
    if cfg.train.lora.enabled:
        raise ValueError(f"{run_dir}: a LoRA run (train.lora.rank={cfg.train.lora.rank}), whose checkpoint holds "
                         "its adapters and not the base: export the adapters as a peft folder (--adapters-only), "
                         f"or merge them first (dropless merge-lora {run_dir} --out RUN2) and export RUN2")
    hf_cfg = mapping.hf_config(cfg.model, family, name)  # refuses what the family cannot express
    tok = tokenizer_folder(cfg.data.tokenizer, cfg.data.tokenizer_path)
    if tok is not None and not (tok / "tokenizer.json").is_file():
        raise ValueError(f"data.tokenizer_path={cfg.data.tokenizer_path!r}: no tokenizer.json there to export")
    model = mapping.meta_model(cfg.model)  # shapes only: no storage
    table = mapping.slots(model, family)
    tensors = open_tensors(path)
    check(tensors, expected_specs(model, table), str(path))
    if cfg.model.mtp_depth and not (family == "deepseek_v3" and model.mtp_moe_layers()):
        n = sum(p.numel() for p in model.mtp.parameters())
        print(f"dropless export-hf: model.mtp_depth={cfg.model.mtp_depth}: the multi-token prediction "
              f"modules ({n:,} parameters) are training-only and left out; the export is the main model",
              file=sys.stderr)
    with atomic.build_dir(out) as tmp:
        files = write_shards(tensors, table, torch_dtype, tmp, int(max_shard_mb * 2**20), progress)
        if tok is not None:
            for n in TOKENIZER_FILES:
                if (tok / n).is_file():
                    shutil.copy2(tok / n, tmp / n)
                    files.append(n)
            gen = tok / "generation_config.json"
            if gen.is_file():  # the special token ids the tokenizer's checkpoint declared
                ids = json.loads(gen.read_text())
                hf_cfg.update({k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in ids})
        else:
            print(f"dropless export-hf: warning: data.tokenizer={cfg.data.tokenizer!r}: no tokenizer files "
                  "to export (transformers has no byte tokenizer)", file=sys.stderr)
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    return ["config.json", *files]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless export-hf",
                                description="Export a run as a Hugging Face checkpoint (Qwen3-MoE, Mixtral or DeepSeek-V3).")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--family", required=True, help=" | ".join(mapping.FAMILIES))
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16 (the stored weights)")
    p.add_argument("--max-shard-size-mb", type=float, default=5000.0, help="largest shard, MiB")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--adapters-only", action="store_true",
                   help="a LoRA run's adapters as a peft adapter folder (adapter_config.json, adapter_model.safetensors)")
    args = p.parse_args(argv)
    try:
        files = export(args.run_dir, args.out, args.family, args.dtype, args.max_shard_size_mb,
                       progress=not args.no_progress, adapters_only=args.adapters_only)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless export-hf: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.run_dir} as {args.family} into {args.out}: {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
