"""The memory figures of `dropless bench load` (bench/load.py): this process's resident and peak
bytes from /proc, the bytes a placed model keeps, the whole model's bytes, and the largest tensor of
a safetensors checkpoint.

Resident and peak come from /proc/self/status (VmRSS, VmHWM), Linux only. The high-water mark is
reset by writing 5 to /proc/self/clear_refs (Linux >= 4.0), which makes VmHWM the peak since that
moment; `resource.getrusage(...).ru_maxrss` keeps the lifetime peak and cannot be reset, so a
process that peaked while importing (or at an earlier load) would hide the load's own peak.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from ..config import RunConfig

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def require_proc() -> None:
    if not STATUS.is_file():
        raise ValueError(f"{STATUS}: not readable; bench load reads resident memory from /proc (Linux only)")


def vm_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{STATUS}: no {field} line")


def reset_peak() -> bool:
    """Reset VmHWM to the current VmRSS; False where the kernel refuses."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def resident_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the storages behind `tensors` (a DTensor's local shard), each storage once."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def model_bytes(cfg: RunConfig) -> int:
    """The unsharded model's parameter and buffer bytes, as the trainer builds it (fp32 master
    weights), counted on the meta device (no memory)."""
    from ..model import MoEModel

    with torch.device("meta"):
        model = MoEModel(cfg.model)
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def largest_tensor(hf_dir: str | Path) -> tuple[str, int]:
    """(name, bytes as stored) of the checkpoint's largest tensor, from the safetensors headers
    (8-byte little-endian header length, then a JSON map name -> dtype, shape, data_offsets)."""
    from ..hf import import_hf

    best = ("", 0)
    for path in import_hf.shard_files(hf_dir):
        try:
            with open(path, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            sizes = {name: m["data_offsets"][1] - m["data_offsets"][0]
                     for name, m in header.items() if name != "__metadata__"}
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise ValueError(f"{path}: cannot read the safetensors header ({type(e).__name__}: {e})") from e
        for name, size in sizes.items():
            if size > best[1]:
                best = (name, size)
    return best


def gib(n: int) -> str:
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:.1f} KiB"
