"""Read a Hugging Face checkpoint into a model's local shards, slice by slice.

Every tensor of the checkpoint maps to a region of one dropless parameter (hf/mapping.py's Slot:
the parameter, an index whose first entry selects rows of dim 0, and whether the HF tensor is that
region transposed). A process holds rows [s, s + n) of each parameter (distributed/materialize.py:
FSDP2 shards and EP slices both cut dim 0; one process holds all rows). For each slot it reads,
through safetensors' memory map (`get_slice`), only the part of the HF tensor that lands in its
rows, and copies it straight into its local shard, cast to the parameter's dtype:

    slot rows                 what is read
    expert e (int index)      the whole [F, D] / [D, F] tensor when s <= e < s + n, else nothing
    rows [a, b) (slice)       HF rows [max(a, s) - a, min(b, s + n) - a) (columns when transposed 2-D)
    the whole parameter       as rows [0, N)

So no process reads the whole file set, holds a full expert stack, or a second copy of the model:
beyond its shards it holds one slice at a time (at most the largest single HF tensor). A tensor
stored as float8 with block scales (DeepSeek-V3) is read whole with its scales and dequantised,
then cut (hf/fp8.py). Names, shapes and completeness are checked from the headers alone, the same
on every process: a missing, unexpected, misshapen or duplicated tensor is a ValueError naming it.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..layers import init
from ..model import MoEModel
from . import fp8, mapping
from .optional import require

INDEX_FILE = "model.safetensors.index.json"
# buffers some older checkpoints store (recomputed from the config by both libraries)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "F8_E4M3": torch.float8_e4m3fn}


def safe_open() -> Any:
    return require("safetensors", "dropless import-hf / export-hf", "safe_open")


@dataclass
class LoadStats:
    bytes_read: int = 0  # bytes of the slices read from the files (this process)
    tensors_read: int = 0
    largest_tensor_bytes: int = 0  # the largest single HF tensor in the files (stored bytes)
    skipped: list[str] = field(default_factory=list)


def _rows(idx0: Any, n_rows: int) -> tuple[int, int, bool]:
    """(first, end, is_single_row) of a slot index's dim-0 entry."""
    if isinstance(idx0, int):
        return idx0, idx0 + 1, True
    start, stop, step = idx0.indices(n_rows)
    if step != 1:
        raise ValueError(f"slot rows {idx0}: strided rows are not supported")
    return start, stop, False


def _plan(slot: mapping.Slot, rows: int, part: init.LocalRows) -> tuple[tuple, tuple] | None:
    """(what to read of the HF tensor, where it goes in the local shard), or None when no row of the
    slot is this process's."""
    index = slot.index or (slice(None),)
    a, b, single = _rows(index[0], rows)
    n = part.tensor.shape[0] if part.tensor.dim() else 1
    lo, hi = max(a, part.start), min(b, part.start + n)
    if lo >= hi:
        return None
    rest = tuple(index[1:])
    if single:  # one expert's tensor: read whole, lands in row e of the shard
        return (), (lo - part.start, *rest)
    hf_rows = slice(lo - a, hi - a)
    dims = len(slot.shape)
    # the region keeps dim 0 of the parameter; transposed, that is the HF tensor's dim 1 when the
    # region is 2-D (a [in, out] matrix stored [out, in]), else dim 0 (a stack [E, x, y] as [E, y, x])
    read = (slice(None), hf_rows) if (slot.transpose and dims == 2) else (hf_rows,)
    return read, (slice(lo - part.start, hi - part.start), *rest)


class _Files:
    """The checkpoint's files, opened lazily, and where each tensor lives."""

    def __init__(self, hf_dir: Path, files: list[Path]) -> None:
        self.dir, self.files, self._open = hf_dir, files, safe_open()
        index = hf_dir / INDEX_FILE
        self.weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else {}

    def handle(self, path: Path) -> Any:
        try:
            return self._open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own SafetensorError (truncated file, bad header)
            raise ValueError(f"{path}: cannot read safetensors file ({type(e).__name__}: {e})") from e

    def scale_of(self, name: str, path: Path) -> torch.Tensor:
        scale = name + fp8.SCALE_SUFFIX
        where = self.dir / self.weight_map.get(scale, path.name)
        with self.handle(where) as f:
            if scale in f.keys():
                return f.get_tensor(scale)
        raise ValueError(f"tensor {name} in {path.name}: float8 weight without its {scale} "
                         f"(looked in {where.name})")


def _check_names(slots: dict[str, mapping.Slot], alternates: dict[str, mapping.Slot], names: dict[str, tuple],
                 model: MoEModel, family: str, block: int | None, params: dict[str, torch.Tensor]) -> list[str]:
    """Every name and shape from the headers: the names to read; ValueError for anything wrong."""
    tied = model.head.weight is model.embed.weight
    unexpected, read = [], []
    filled: dict[str, int] = defaultdict(int)
    for name, (shape, path, dtype) in names.items():
        slot = slots.get(name) or alternates.get(name)
        if slot is None:
            if not (name.endswith(fp8.SCALE_SUFFIX) and block is not None) and \
                    not (name == "lm_head.weight" and tied) and not name.endswith(IGNORED_SUFFIXES):
                unexpected.append(name)
            continue
        _check_dtype(name, path, dtype, block)
        if shape != slot.shape:
            raise ValueError(f"tensor {name} in {path.name}: shape {shape}, but config.json implies {slot.shape}")
        if not slot.copy:  # (a copy repeats a parameter another slot fills: compared, not counted)
            filled[slot.param] += math.prod(shape)
        read.append(name)
    if unexpected:
        raise ValueError(f"unexpected tensors (not part of a {family} model with this config.json): "
                         f"{', '.join(sorted(unexpected)[:8])}{' ...' if len(unexpected) > 8 else ''}")
    twice = [n for n, c in filled.items() if c > params[n].numel()]
    if twice:
        raise ValueError(f"the checkpoint holds some weights twice (per-expert and fused layouts?): {twice[:4]}")
    missing = [s.hf_name for s in slots.values()
               if s.hf_name not in names and (s.copy or filled[s.param] < params[s.param].numel())]
    if missing:
        raise ValueError(f"missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    return read


def _check_dtype(name: str, path: Path, dtype: str, block: int | None) -> None:
    t = _DTYPES.get(dtype)
    if not (t in (torch.float32, torch.bfloat16, torch.float16) or (t in fp8.FP8_DTYPES and block is not None)):
        shown = t if t is not None else dtype
        raise ValueError(f"tensor {name} in {path.name}: dtype {shown} is not supported "
                         "(fp32, bf16, fp16, or float8_e4m3fn with block scales and a "
                         "quantization_config in config.json)")


@torch.no_grad()
def load_local(model: MoEModel, hf_dir: str | Path, family: str, files: list[Path], block: int | None,
               where: init.Where = init.whole, progress: bool = False) -> LoadStats:
    """Fill this process's rows of every parameter of `model` (built from the checkpoint's
    config.json, materialised, possibly sharded: `where`) from the checkpoint (module note)."""
    hf_dir, stats = Path(hf_dir), LoadStats()
    # the global shapes and the table from a meta twin: the model's own parameters may be shards
    twin = mapping.meta_model(model.cfg)
    slots = {s.hf_name: s for s in mapping.slots(twin, family)}
    alternates = {s.hf_name: s for s in mapping.fused_slots(twin, family)}
    globals_ = {**dict(twin.named_parameters()), **dict(twin.named_buffers())}
    local = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    reader = _Files(hf_dir, files)
    names: dict[str, tuple] = {}
    for path in files:
        with reader.handle(path) as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                names[name] = (shape, path, sl.get_dtype())
                size = math.prod(shape) * _DTYPES.get(sl.get_dtype(), torch.uint8).itemsize
                stats.largest_tensor_bytes = max(stats.largest_tensor_bytes, size)
    to_read = set(_check_names(slots, alternates, names, twin, family, block, globals_))
    parts = {p: where(p, t) for p, t in local.items()}
    copies: list[tuple[str, Path]] = []
    for path in progress_bar(files, progress):
        with reader.handle(path) as f:
            for name in f.keys():
                if name not in to_read:
                    continue
                slot = slots.get(name) or alternates[name]
                if slot.copy:  # compared once every parameter is filled
                    copies.append((name, path))
                    continue
                plan = _plan(slot, globals_[slot.param].shape[0] if globals_[slot.param].dim() else 1,
                             parts[slot.param])
                if plan is None:
                    continue
                read, dest = plan
                t = _read(f, name, read, slot, reader, path, block)
                stats.bytes_read += t.numel() * t.element_size()
                stats.tensors_read += 1
                region = parts[slot.param].tensor[dest]
                region.copy_(t.transpose(-1, -2) if slot.transpose else t)
    for name, path in copies:
        _compare_copy(name, path, slots[name], reader, globals_, parts, block, stats)
    return stats


def _compare_copy(name: str, path: Path, slot: mapping.Slot, reader: _Files, globals_: dict[str, torch.Tensor],
                  parts: dict[str, init.LocalRows], block: int | None, stats: LoadStats) -> None:
    """A tensor that repeats a parameter (DeepSeek-V3's MTP layers store the shared embedding and
    head again): this process's rows of it must equal what it loaded."""
    g = globals_[slot.param]
    plan = _plan(slot, g.shape[0] if g.dim() else 1, parts[slot.param])
    if plan is None:
        return
    read, dest = plan
    with reader.handle(path) as f:
        t = _read(f, name, read, slot, reader, path, block)
    stats.bytes_read += t.numel() * t.element_size()
    region = parts[slot.param].tensor[dest]
    t = t.transpose(-1, -2) if slot.transpose else t
    if not torch.equal(t.to(region.dtype), region):
        raise ValueError(f"tensor {name} in {path.name}: not equal to {slot.param}'s tensor, which it "
                         "repeats (dropless shares one embedding and one head with the MTP layers)")


def _read(f: Any, name: str, read: tuple, slot: mapping.Slot, reader: _Files, path: Path,
          block: int | None) -> torch.Tensor:
    sl = f.get_slice(name)
    if _DTYPES.get(sl.get_dtype()) in fp8.FP8_DTYPES:  # (dtypes checked with the names: a block is set)
        t = fp8.dequantize(f.get_tensor(name), reader.scale_of(name, path), block)
        return t[read] if read else t
    return sl[read] if read else sl[:]


def progress_bar(items: list[Any], enabled: bool) -> Any:
    """`items` with a tqdm bar over shards on stderr when enabled (and tqdm is installed)."""
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="shards", unit="shard", file=sys.stderr)
