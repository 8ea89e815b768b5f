"""Atomic checkpoints and RNG state capture.

Layout under a run directory:

    run_dir/checkpoints/
        step_000123/.metadata     the trainer's checkpoints: a torch.distributed.checkpoint folder
        step_000123/trainer.pt    at every world size, one process included (dist_checkpoint.py)
        step_000123/state.pt      ... or one torch.save file (`save_checkpoint`: generic dicts, and
                                  the trainer's one-process checkpoints before the formats were merged)
        step_000123/COMPLETE      the marker: a checkpoint without it does not exist
        latest                    text: the name of the newest saved checkpoint, for people and tools
        .tmp-step_000456-<tag>/   an unfinished save (a crash); ignored, safe to delete

Design notes
- A crash (OOM kill, preemption, full disk) can happen at any byte of a save. The save therefore
  writes everything into a hidden temporary folder, fsyncs the files and the folder, writes the
  `COMPLETE` marker last, fsyncs again, and only then renames the folder to `step_NNNNNN`. A rename
  within one filesystem is atomic, so a reader sees either no checkpoint or a whole one; fsync before
  the rename stops the kernel from persisting the rename before the data (the classic
  zero-length-file-after-power-loss). The `latest` pointer is replaced the same way (atomic.py).
- `latest_checkpoint` does not trust `latest`: it scans for `step_*` folders that have the marker
  and a `state.pt` or DCP `.metadata`, and returns the highest step. A crash between the folder rename and the pointer
  update then costs nothing; the pointer is a convenience, not the source of truth.
- Saving a step that already exists (re-running from an earlier checkpoint) moves the old folder
  aside, renames the new one in, then deletes the old one. In the gap between those renames the step
  is briefly absent, never half-written.
- Only one process should publish into a run directory (rank 0; the ranks of a distributed save all
  write into one `.tmp-...-dcp` folder first); the pid in a one-process temporary name just keeps two
  accidental writers from sharing a folder.
- `load_checkpoint` uses `torch.load(weights_only=True)` by default: tensors, dicts, lists, tuples,
  numbers and strings load; arbitrary pickled objects do not. Store configs as plain dicts.
- `rng_state()` / `set_rng_state()` cover torch CPU, every visible CUDA device and Python's
  `random`. The data sampler needs none of this (its batches are a function of the step; see
  `data.py`); it is for dropout and anything else that draws from the global generators.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from .. import atomic

__all__ = [
    "CHECKPOINT_DIR",
    "COMPLETE_MARKER",
    "STATE_FILE",
    "checkpoint_name",
    "save_checkpoint",
    "list_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
]

CHECKPOINT_DIR = "checkpoints"
COMPLETE_MARKER = "COMPLETE"
STATE_FILE = "state.pt"
DCP_METADATA = ".metadata"  # written last by torch.distributed.checkpoint.save
LATEST_FILE = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got step={step}")
    return f"step_{step:06d}"


def _write_file_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file() and ((path / STATE_FILE).is_file()
                                                   or (path / DCP_METADATA).is_file())


def is_dcp_checkpoint(path: Path) -> bool:
    """A torch.distributed.checkpoint folder (the trainer's format at every world size), as opposed to
    a `state.pt` one."""
    return (Path(path) / DCP_METADATA).is_file()


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under run_dir, oldest first."""
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    if not ckpt_dir.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    for p in ckpt_dir.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and _is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None when there is none."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(
    run_dir: str | Path, step: int, state: dict[str, Any], *, keep_last: int | None = None
) -> Path:
    """Atomically write `state` as run_dir/checkpoints/step_NNNNNN; return that folder.

    keep_last: after a successful save, delete all but the newest `keep_last` complete checkpoints.
    """
    if not isinstance(state, dict):
        raise ValueError(f"save_checkpoint: state must be a dict, got {type(state).__name__}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(
            f"save_checkpoint: keep_last must be >= 1 or None, got keep_last={keep_last}"
        )
    tmp = temp_dir(run_dir, step, os.getpid())
    with open(tmp / STATE_FILE, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return publish(run_dir, step, tmp, keep_last=keep_last)


def temp_path(run_dir: str | Path, step: int, tag: int | str) -> Path:
    """The hidden folder checkpoint `step` is written into by the writer(s) named `tag`: every rank
    of a distributed save names the same one, so it is fixed, not `atomic.temp_sibling`'s."""
    return Path(run_dir) / CHECKPOINT_DIR / f".tmp-{checkpoint_name(step)}-{tag}"


def temp_dir(run_dir: str | Path, step: int, tag: int | str) -> Path:
    """A fresh hidden folder to write checkpoint `step` into (removed first if a crash left it)."""
    tmp = temp_path(run_dir, step, tag)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def publish(run_dir: str | Path, step: int, tmp: Path, *, keep_last: int | None = None) -> Path:
    """Turn a fully written (and fsynced) temporary folder into checkpoint `step`: marker, fsync,
    atomic rename, `latest` pointer, pruning. One process only."""
    name = checkpoint_name(step)
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    _write_file_synced(tmp / COMPLETE_MARKER, f"{step}\n".encode())
    final = atomic.publish_dir(tmp, ckpt_dir / name, replace=True, fsync=True)
    atomic.write_bytes(ckpt_dir / LATEST_FILE, f"{name}\n".encode(), fsync=True)

    if keep_last is not None:
        for _, path in list_checkpoints(run_dir)[:-keep_last]:
            # Remove the marker first: if deletion is interrupted, the leftover is not "complete".
            (path / COMPLETE_MARKER).unlink(missing_ok=True)
            shutil.rmtree(path)
    return final


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, weights_only: bool = True
) -> dict[str, Any]:
    """Load a checkpoint folder (or its state.pt); refuses folders without the COMPLETE marker."""
    p = Path(path)
    if p.is_dir():
        if not (p / COMPLETE_MARKER).is_file():
            raise ValueError(
                f"load_checkpoint: {str(p)!r} has no {COMPLETE_MARKER} marker (unfinished save)"
            )
        p = p / STATE_FILE
    if not p.is_file():
        raise FileNotFoundError(f"load_checkpoint: no checkpoint at path={str(path)!r}")
    state = torch.load(p, map_location=map_location, weights_only=weights_only)
    if not isinstance(state, dict):
        raise ValueError(f"load_checkpoint: {str(p)!r} holds {type(state).__name__}, expected dict")
    return state


def rng_state() -> dict[str, Any]:
    """The global RNG states: torch CPU, each CUDA device (if available), Python `random`."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` captured. CUDA states are restored for the devices both have."""
    for key in ("torch", "python"):
        if key not in state:
            raise ValueError(f"set_rng_state: state has no {key!r} entry (keys: {sorted(state)})")
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))  # a load may turn the tuple into a list
    if "cuda" in state and torch.cuda.is_available():
        for device, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), device)
