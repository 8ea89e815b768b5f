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

Memory: the tensor returned and nothing else when one piece holds all of it (a checkpoint written
by one process, or a replicated tensor): that piece, deserialised straight from its place in the
file, is the tensor. A tensor in several pieces (each rank's shard) is allocated once and each
piece copied into place: the tensor plus one piece. (A plain DCP load would deserialise each piece
and copy it into a tensor allocated beforehand: twice the tensor for a one-piece tensor.) Pieces
the writer transformed (compressed) go through DCP's own load. Nothing is cached: holding on to a
tensor is the caller's choice.

The model's tensors live under "model." (dist_checkpoint saves {"model": ..., "optim": ...});
`Tensors` takes and gives the model's own names (`blocks.0.ffn.experts.w_gate_up_EDF`). The optimizer
state reads the same way with `prefix=OPTIM_STATE_PREFIX`, by the parameter's name and the state's key
(`blocks.0.ffn.experts.w_gate_up_EDF.exp_avg`), also at its global shape (the experts' included).

An older one-process `state.pt` checkpoint (runs/checkpoint.py) holds the model in one torch.save
pickle, which cannot be read a piece at a time: `StateTensors` loads it whole and serves the same
interface.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import checkpoint as ckpt

MODEL_PREFIX = "model."  # dist_checkpoint's key of the model state dict
OPTIM_STATE_PREFIX = "optim.state."  # ... and of the optimizer's per-parameter state, flattened by DCP


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
    """One DCP checkpoint folder, read one tensor per `read` (module note): the model's tensors, or
    with `prefix=OPTIM_STATE_PREFIX` the optimizer's state."""

    def __init__(self, path: str | Path, prefix: str = MODEL_PREFIX) -> None:
        self.path, self.prefix = Path(path), prefix
        metadata = dcp.FileSystemReader(str(self.path)).read_metadata()
        self.storage = metadata.storage_data or {}  # (name, offsets) -> file, byte offset, length
        self.specs = {k[len(prefix):]: TensorSpec(tuple(md.size), md.properties.dtype)
                      for k, md in metadata.state_dict_metadata.items()
                      if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` at its global shape and stored dtype, on the CPU."""
        spec = self.specs[name]
        pieces = [(idx.offset, info) for idx, info in self.storage.items() if idx.fqn == self.prefix + name]
        if pieces and not any(info.transform_descriptors for _, info in pieces):
            return self._read_pieces(spec, pieces)
        t = torch.empty(spec.shape, dtype=spec.dtype)
        with warnings.catch_warnings():
            # no_dist=True is the intent here: DCP still warns that no process group exists
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({self.prefix + name: t}, checkpoint_id=str(self.path), no_dist=True,
                     planner=DefaultLoadPlanner())  # strict: a missing key raises (module note)
        return t


    def _read_pieces(self, spec: TensorSpec, pieces: list) -> torch.Tensor:
        """Each stored piece deserialised from its window of its file (torch.load reads the window
        through seeks, not into a buffer first) and put at its offsets (module note)."""
        out = None
        for offsets, info in pieces:
            with open(self.path / info.relative_path, "rb") as f:
                piece = torch.load(_Window(f, info.offset, info.length), map_location="cpu", weights_only=True)
            if len(pieces) == 1 and tuple(piece.shape) == spec.shape:
                return piece if piece.dtype == spec.dtype else piece.to(spec.dtype)
            if out is None:
                out = torch.empty(spec.shape, dtype=spec.dtype)
            out[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))].copy_(piece)
            del piece
        return out


class _Window(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start + length) of an open file."""

    def __init__(self, f: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, min(self.length, base + offset))
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buf)[:n])
        self.pos += got
        return got


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
