"""Read named tensors one at a time from a checkpoint, in one process, without building the model.

A DCP checkpoint (runs/dist_checkpoint.py) stores every tensor by name at its global shape, whatever
world size and expert-parallel size wrote it: the routed experts as one [E, ...] tensor assembled
from every rank's slice. Its `.metadata` file lists each tensor's global shape and dtype, so a reader
can check a checkpoint against a model built on the meta device, and then load one tensor at a time:
a DCP load (`no_dist=True`: no process group) of a state dict holding that one tensor, allocated at
its global shape and stored dtype. DCP reads only the pieces that tensor is made of, from whichever
rank files hold them; the checkpoint's other tensors (and the optimizer state) are simply not asked
for. The planner is the strict default on purpose: `allow_partial_load=True` means "a requested key
may be absent from the checkpoint", and would hand back the uninitialised tensor for a wrong name.

Memory: the tensor returned, plus, while it is read, the one stored piece DCP is copying into it
(FileSystemReader deserialises each stored piece, then copies it into place). Nothing is cached:
holding on to a tensor is the caller's choice.

The model's tensors live under "model." (dist_checkpoint saves {"model": ..., "optim": ...});
`Tensors` takes and gives the model's own names (`blocks.0.ffn.experts.w_gate_up_EDF`).

An older one-process `state.pt` checkpoint (runs/checkpoint.py) holds the model in one torch.save
pickle, which cannot be read a piece at a time: `StateTensors` loads it whole and serves the same
interface.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import checkpoint as ckpt

MODEL_PREFIX = "model."  # dist_checkpoint's key of the model state dict


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


class Tensors(Protocol):
    """The model tensors of one checkpoint, by the model's own names."""

    specs: dict[str, TensorSpec]

    def read(self, name: str) -> torch.Tensor: ...


def check(tensors: Tensors, expected: dict[str, TensorSpec], where: str) -> None:
    """A ValueError naming the first tensor of `expected` that the checkpoint lacks or stores at another
    shape or dtype (before anything is read)."""
    for name, want in expected.items():
        got = tensors.specs.get(name)
        if got is None:
            raise ValueError(f"{where}: tensor {MODEL_PREFIX}{name} is missing from the checkpoint")
        if got != want:
            raise ValueError(f"{where}: tensor {MODEL_PREFIX}{name} is stored as {list(got.shape)} {got.dtype}; "
                             f"the run's model has {list(want.shape)} {want.dtype}")


class DCPTensors:
    """One DCP checkpoint folder, read one tensor per `read` (module note)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        metadata = dcp.FileSystemReader(str(self.path)).read_metadata()
        self.specs = {k[len(MODEL_PREFIX):]: TensorSpec(tuple(md.size), md.properties.dtype)
                      for k, md in metadata.state_dict_metadata.items()
                      if k.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` at its global shape and stored dtype, on the CPU."""
        spec = self.specs[name]
        t = torch.empty(spec.shape, dtype=spec.dtype)
        with warnings.catch_warnings():
            # no_dist=True is the intent here: DCP still warns that no process group exists
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({MODEL_PREFIX + name: t}, checkpoint_id=str(self.path), no_dist=True,
                     planner=DefaultLoadPlanner())  # strict: a missing key raises (module note)
        return t


class StateTensors:
    """An older one-process `state.pt` checkpoint: its model state dict, loaded whole (module note)."""

    def __init__(self, path: str | Path) -> None:
        self.state = ckpt.load_checkpoint(path)["model"]
        self.specs = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in self.state.items()}

    def read(self, name: str) -> torch.Tensor:
        return self.state[name]


def open_tensors(path: str | Path) -> Tensors:
    """The model tensors of a checkpoint folder, DCP or `state.pt`."""
    return DCPTensors(path) if ckpt.is_dcp_checkpoint(path) else StateTensors(path)
