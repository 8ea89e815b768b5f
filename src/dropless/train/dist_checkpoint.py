"""Distributed checkpoints: torch.distributed.checkpoint (DCP), resumable at another world size.

Every rank writes its own shards into one folder, in parallel; the folder is published with the same
atomic protocol as a one-process checkpoint (checkpoint.py): all ranks write into a hidden temporary
folder, rank 0 writes `trainer.pt` (step, RNG, health, config), a barrier makes sure every rank's
files are on disk (DCP's writer fsyncs them), then rank 0 alone writes the COMPLETE marker and renames
the folder. A rank that dies mid-save leaves only the hidden folder, which no loader reads.

Resharding. Dense parameters and their optimizer state are FSDP2 DTensors (Shard(0) over dp): DCP
stores them by global offsets, so any world size can read them. The routed experts are the exception:
after EP each rank holds a different slice of E under the same name, which FSDP sees as an [L, ...]
tensor on the edp mesh. Before saving (and loading) they are re-described, without a copy, as
DTensors of the global [E, ...] shape on the (ep, edp) checkpoint mesh with placements
(Shard(0), Shard(0)) (distributed/parallelize.py): each rank's bytes land at their global offset, so
a checkpoint written at (ep, edp) = (2, 2) loads at (2, 1), (1, 2), ...

Because the experts are stored at their global shape, the model part also loads into the plain
one-device model, without a process group (`load_full_model`; `dropless generate` uses it).

RNG: rank 0's generator states are saved and every rank restores them (training draws no random
numbers on the device path; batches are a function of (seed, step, micro-step)).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from ..distributed.parallelize import Meshes
from . import checkpoint as ckpt

TRAINER_FILE = "trainer.pt"


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _to_global(t: DTensor, meshes: Meshes) -> DTensor:
    """An expert tensor [L, ...] on the edp mesh -> the same bytes as [E, ...] on the ckpt mesh."""
    ep = meshes.mesh.size(1)
    shape = (t.shape[0] * ep, *t.shape[1:])
    return DTensor.from_local(t.to_local(), meshes.expert_ckpt, [Shard(0), Shard(0)], run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _to_local(t: DTensor, meshes: Meshes) -> DTensor:
    ep = meshes.mesh.size(1)
    shape = (t.shape[0] // ep, *t.shape[1:])
    return DTensor.from_local(t.to_local(), meshes.mesh["edp"], [Shard(0)], run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _convert(model_sd: dict, optim_sd: dict, experts: list[str], fn) -> tuple[dict, dict]:
    model_sd = {k: fn(v) if k in experts else v for k, v in model_sd.items()}
    state = {k: ({n: fn(v) if isinstance(v, DTensor) else v for n, v in s.items()} if k in experts else s)
             for k, s in optim_sd["state"].items()}
    return model_sd, {**optim_sd, "state": state}


def save(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         experts: list[str], meshes: Meshes, trainer_state: dict[str, Any], keep_last: int | None) -> Path:
    """Collective: every rank calls it. Returns the published folder (on every rank)."""
    rank = dist.get_rank()
    tmp = Path(run_dir) / ckpt.CHECKPOINT_DIR / f".tmp-{ckpt.checkpoint_name(step)}-dcp"
    if rank == 0:
        ckpt.temp_dir(run_dir, step, "dcp")  # (re)created empty
    dist.barrier()
    model_sd, optim_sd = _convert(get_model_state_dict(model), get_optimizer_state_dict(model, optimizer),
                                  experts, lambda t: _to_global(t, meshes))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    if rank == 0:
        with open(tmp / TRAINER_FILE, "wb") as f:
            torch.save(trainer_state, f)
    dist.barrier()  # every rank's shards are written and synced
    final = Path(run_dir) / ckpt.CHECKPOINT_DIR / ckpt.checkpoint_name(step)
    if rank == 0:
        ckpt.publish(run_dir, step, tmp, keep_last=keep_last)
    dist.barrier()
    return final


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, experts: list[str],
         meshes: Meshes) -> dict[str, Any]:
    """Collective: fill model and optimizer from a DCP checkpoint written at any world size; returns
    the trainer state (step, RNG, ...)."""
    if not (Path(path) / ckpt.COMPLETE_MARKER).is_file():
        raise ValueError(f"load: {str(path)!r} has no {ckpt.COMPLETE_MARKER} marker (unfinished save)")
    model_sd, optim_sd = _convert(get_model_state_dict(model), get_optimizer_state_dict(model, optimizer),
                                  experts, lambda t: _to_global(t, meshes))
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    model_sd, optim_sd = _convert(state["model"], state["optim"], experts, lambda t: _to_local(t, meshes))
    set_model_state_dict(model, model_sd)
    set_optimizer_state_dict(model, optimizer, optim_sd)
    return trainer_state(path)


def load_full_model(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """One process, no process group: fill a one-device `model` (all E experts) from a distributed
    checkpoint; returns the trainer state (its "config" builds the model)."""
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        # no_dist=True is the intent here: DCP still warns that no process group exists
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])
    return trainer_state(path)


def trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(Path(path) / TRAINER_FILE, weights_only=True)
