"""The trainer's checkpoints: one format, torch.distributed.checkpoint (DCP), at every world size.

A checkpoint written by any number of processes (one included) resumes at any other (1 -> 4 -> 2):

    step_000123/.metadata, __R_0.distcp   DCP: model and optimizer state, each tensor at its global
                                          shape, in every rank's shards
    step_000123/trainer.pt                torch.save (rank 0): step, RNG, config, world size, the
                                          routing monitor's state (every rank's accumulator sums)
    step_000123/COMPLETE                  the marker (checkpoint.py)

Why DCP at one process too: it stores every tensor by name at its global shape with the offsets of
the piece each rank held, and reads any piece back for any layout, so one format needs no converter.
One process saves and loads it without a process group (`no_dist=True`); the state dicts come from
`get_model_state_dict` / `get_optimizer_state_dict` at every world size, so the optimizer state is
keyed by parameter name (not by position) in all of them. The older one-process format (a torch.save
`state.pt`) still loads in one process (train/run_dir.py) and in `dropless generate`.

Publishing uses the atomic protocol of checkpoint.py: every rank writes into one hidden temporary
folder (DCP's writer fsyncs its files), rank 0 writes `trainer.pt` (fsynced), a barrier makes sure every
rank's files are on disk, then rank 0 alone writes the COMPLETE marker and renames the folder. A rank
that dies mid-save leaves only the hidden folder, which no loader reads.

Resharding. Dense parameters and their optimizer state are FSDP2 DTensors (Shard(0) over dp) or, in one
process, plain tensors: DCP matches them by name and global offsets. The routed experts are the
exception: after EP each rank holds a different slice of E under the same name, which FSDP sees as an
[L, ...] tensor on the edp mesh. Before saving (and loading) they are re-described, without a copy, as
DTensors of the global [E, ...] shape on the (ep, edp) checkpoint mesh with placements (Shard(0),
Shard(0)) (distributed/parallelize.py): each rank's bytes land at their global offset, so a checkpoint
written at (ep, edp) = (2, 2) loads at (2, 1), (1, 2), or one process's plain [E, ...] tensor. Without
FSDP2 (parallel.fsdp=false, distributed/replicated.py) the dense tensors are plain and whole on every
rank (DCP saves one copy) and an expert's [L, ...] slice is (Shard(0), Replicate()): the same
checkpoint format, so either layout resumes the other's.

A LoRA run (train.lora, the model's `lora` set) saves and loads what trains (the adapters, a trained
router), the buffers and the optimizer state, never its frozen base: the base is rebuilt from
`train.lora.base_from` at every start (runs/lora_base.py), and trainer.pt holds its digest.

RNG: rank 0's generator states are saved and every rank restores them (batches are a function of
(seed, step, micro-step); the one draw on the device, forced_balance routing, draws the same on
every rank, so rank 0's states serve all). The routing
accumulators are per rank: `gather_health` collects them for trainer.pt, and
`StepAccumulator.state_for_rank` hands them back, resharded when the world size changed.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..distributed.mesh import Meshes
from . import checkpoint as ckpt

TRAINER_FILE = "trainer.pt"


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _to_global(t: torch.Tensor, meshes: Meshes) -> DTensor:
    """An expert tensor [L, ...] on the edp mesh -> the same bytes as [E, ...] on the ckpt mesh. A
    plain [L, ...] (parallel.fsdp=false) is the same on every edp rank: Replicate() over edp."""
    ep = meshes.mesh.size(1)
    shape = (t.shape[0] * ep, *t.shape[1:])
    local, inner = (t.to_local(), Shard(0)) if isinstance(t, DTensor) else (t, Replicate())
    return DTensor.from_local(local, meshes.expert_ckpt, [Shard(0), inner], run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _to_local(t: DTensor, meshes: Meshes) -> torch.Tensor:
    if isinstance(t.placements[1], Replicate):  # the replicated layout's plain [L, ...]
        return t.to_local()
    ep = meshes.mesh.size(1)
    shape = (t.shape[0] // ep, *t.shape[1:])
    return DTensor.from_local(t.to_local(), meshes.mesh["edp"], [Shard(0)], run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _expert_state(v: Any) -> bool:
    """An optimizer state tensor shaped like its expert parameter (a DTensor under FSDP2, a plain
    [L, ...] without it), not a scalar such as AdamW's step."""
    return isinstance(v, DTensor) or (isinstance(v, torch.Tensor) and v.dim() > 0)


def _convert(model_sd: dict, optim_sd: dict | None, experts: Sequence[str], fn: Callable,
             ) -> tuple[dict, dict | None]:
    model_sd = {k: fn(v) if k in experts else v for k, v in model_sd.items()}
    if optim_sd is None:
        return model_sd, None
    state = {k: ({n: fn(v) if _expert_state(v) else v for n, v in s.items()} if k in experts else s)
             for k, s in optim_sd["state"].items()}
    return model_sd, {**optim_sd, "state": state}


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The frozen base of a LoRA model (module note), which its checkpoints leave out; empty otherwise."""
    if getattr(model, "lora", None) is None:
        return set()
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, experts: Sequence[str],
                 meshes: Meshes | None) -> dict[str, dict]:
    """{"model", "optim"}: name-keyed state dicts with the experts at their global shape ("model"
    alone without an optimizer); a LoRA model's without its frozen base."""
    frozen = frozen_names(model)
    model_sd = {k: v for k, v in get_model_state_dict(model).items() if k not in frozen}
    optim_sd = get_optimizer_state_dict(model, optimizer) if optimizer is not None else None
    if meshes is not None:
        model_sd, optim_sd = _convert(model_sd, optim_sd, experts, lambda t: _to_global(t, meshes))
    return {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}


def _dcp(fn: Callable, state: dict, path: Path, distributed: bool) -> None:
    if distributed:
        fn(state, checkpoint_id=str(path))
        return
    with warnings.catch_warnings():
        # no_dist=True is the intent here: DCP still warns that no process group exists
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, checkpoint_id=str(path), no_dist=True)


def save(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
         trainer_state: dict[str, Any], *, experts: Sequence[str] = (), meshes: Meshes | None = None,
         keep_last: int | None = None) -> Path:
    """Write checkpoint `step`. With `meshes` (several processes) it is collective: every rank calls it
    and gets the published folder; without, one process saves alone. `optimizer` None writes the
    model alone (an imported checkpoint: its trainer state says `"optimizer_state": False`)."""
    distributed = meshes is not None
    rank = dist.get_rank() if distributed else 0
    # Every rank must name the same folder: a fixed tag when several write it, the pid for one writer.
    tag = "dcp" if distributed else str(os.getpid())
    tmp = ckpt.temp_path(run_dir, step, tag)
    if rank == 0:
        ckpt.temp_dir(run_dir, step, tag)  # (re)created empty
    if distributed:
        dist.barrier()
    _dcp(dcp.save, _state_dicts(model, optimizer, experts, meshes), tmp, distributed)
    if rank == 0:
        with open(tmp / TRAINER_FILE, "wb") as f:
            torch.save(trainer_state, f)
            f.flush()
            os.fsync(f.fileno())
    if distributed:
        dist.barrier()  # every rank's shards are written and synced
    final = Path(run_dir) / ckpt.CHECKPOINT_DIR / ckpt.checkpoint_name(step)
    if rank == 0:
        ckpt.publish(run_dir, step, tmp, keep_last=keep_last)
    if distributed:
        dist.barrier()
    return final


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         experts: Sequence[str] = (), meshes: Meshes | None = None,
         optimizer_state: bool = True) -> dict[str, Any]:
    """Fill model and optimizer from a checkpoint written at any world size (collective with
    `meshes`), or from an older one-process `state.pt` (one process only); returns the trainer state
    (step, RNG, ...). `optimizer_state=False` fills the model alone and leaves `optimizer` as built:
    a resume that changed train.optimizer, whose checkpoint holds another optimizer's state (other
    keys: Muon's momentum buffers, AdamW's moments and param-group fields), which DCP cannot load."""
    if not (Path(path) / ckpt.COMPLETE_MARKER).is_file():
        raise ValueError(f"load: {str(path)!r} has no {ckpt.COMPLETE_MARKER} marker (unfinished save)")
    # A param group's settings (betas, eps, weight decay, ...) are the run's config, not state: loading
    # the checkpoint's would silently undo a train.* change on resume, so the built ones are put back.
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if not ckpt.is_dcp_checkpoint(path):
        if meshes is not None:
            raise ValueError(f"--resume: {path} is an older one-process checkpoint (state.pt); resume it "
                             "in one process (its next checkpoint is in the format every world size reads)")
        state = ckpt.load_checkpoint(path)
        model.load_state_dict(state["model"])
        if optimizer_state:
            optimizer.load_state_dict(state["optimizer"])
            _restore_settings(optimizer, settings)
        return state
    state = _state_dicts(model, optimizer if optimizer_state else None, experts, meshes)
    # The param groups are bytes DCP keeps once (rank 0's). Under pipeline stages each rank's groups
    # list its own stages' parameters, so every rank keeps its own: nothing in them is state (the
    # settings are the built ones, below; the per-parameter state is loaded by name).
    own_groups = copy.deepcopy(state["optim"]["param_groups"]) if "optim" in state else None  # (load writes in place)
    _dcp(dcp.load, state, Path(path), meshes is not None)
    if own_groups is not None:
        state["optim"]["param_groups"] = own_groups
    model_sd, optim_sd = state["model"], state.get("optim")
    if meshes is not None:
        model_sd, optim_sd = _convert(model_sd, optim_sd, experts, lambda t: _to_local(t, meshes))
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=not frozen_names(model)))
    if optim_sd is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd)
        _restore_settings(optimizer, settings)
    return trainer_state(path)


def _restore_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    for group, built in zip(optimizer.param_groups, settings, strict=True):
        group.update(built)


def load_full_model(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """One process, no process group: fill a one-device `model` (all E experts) from a checkpoint
    written at any world size; returns the trainer state (its "config" builds the model). A LoRA
    model gets its adapters (its base is filled beforehand: runs/load.py)."""
    frozen = frozen_names(model)
    state = {"model": {k: v for k, v in model.state_dict().items() if k not in frozen}}
    _dcp(dcp.load, state, Path(path), distributed=False)
    missing = model.load_state_dict(state["model"], strict=not frozen).missing_keys
    if not set(missing) <= frozen:  # strict=False only lets the frozen base be absent
        raise ValueError(f"{path}: the checkpoint lacks {sorted(set(missing) - frozen)[:5]}")
    return trainer_state(path)


def trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint folder: trainer.pt, or an older one-process `state.pt`
    (which holds it together with the model and optimizer)."""
    path = Path(path)
    if (path / TRAINER_FILE).is_file():
        return torch.load(path / TRAINER_FILE, map_location="cpu", weights_only=True)
    return ckpt.load_checkpoint(path)


def gather_health(health: dict[str, Any], distributed: bool) -> dict[str, Any]:
    """This rank's `TrainHealth.state_dict()` with "acc" replaced by the list of every rank's routing
    accumulator state (rank 0's copy is the one trainer.pt keeps). Collective when distributed."""
    if not distributed:
        return {**health, "acc": [health["acc"]]}
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(health["acc"], gathered, dst=0)
    return {**health, "acc": gathered}
