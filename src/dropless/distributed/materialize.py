"""A run's model built on the meta device, parallelised there, then materialised: each process
allocates and fills only its own shards, so no process ever holds the whole model.

    MoEModel on meta -> EP then FSDP2 on meta (parallelize.py) -> to_empty on the device -> fill

Filling is either the initial weights, a function of (seed, parameter name) (layers/init.py: the
same values at every world size and EP layout), or a loader (a Hugging Face checkpoint read slice
by slice, hf/import_hf.py) that writes each parameter's local rows. Both are told which rows of
each parameter this process holds by `local_rows`:

    dense parameter (FSDP2, Shard(0) over dp)       rows [c * i, c * (i + 1)) of N, c = ceil(N / W)
                                                    (torch.chunk's split, which FSDP2 uses; the
                                                    last shards may be short or empty)
    routed experts (EP slice j, then Shard(0) over edp)  rows j * L + [c * i, c * (i + 1)) of E,
                                                    L = E / ep, c = ceil(L / edp)
    routed experts without FSDP (parallel.fsdp=false) rows j * L + [0, L) of E
    buffers and anything unsharded                  all rows

The expert rows are the checkpoint mesh's layout (parallelize.py's note): EP slices first, edp
chunks inside them.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Shard

from ..config import LoRAConfig, ModelConfig, ParallelConfig
from ..layers import init
from ..layers import lora as lora_layers
from ..layers.frozen_base import pack_frozen_base
from ..model import MoEModel
from .mesh import Meshes
from .parallelize import parallelize_model
from .parallelize_ep import local_payload

Fill = Callable[[MoEModel, init.Where], None]


def _chunk_start(rows: int, dt: DTensor) -> int:
    """The first row of this process's Shard(0) chunk of `rows` rows on the DTensor's 1-D mesh."""
    if dt.device_mesh.ndim != 1 or list(dt.placements) != [Shard(0)]:
        raise ValueError(f"a parameter sharded as {dt.placements} on a {dt.device_mesh.ndim}-D mesh: "
                         "only Shard(0) on one mesh dimension is laid out here")
    n, i = dt.device_mesh.size(), dt.device_mesh.get_local_rank()
    c = -(-rows // n)
    return min(c * i, rows)


def local_rows(meshes: Meshes, expert_names: list[str]) -> init.Where:
    """This process's rows of each parameter of a model parallelised by parallelize.py (module note)."""
    experts = set(expert_names)
    ep, j = meshes.mesh.size(1), meshes.mesh.get_local_rank(1)

    def where(name: str, p: torch.Tensor) -> init.LocalRows:
        if not isinstance(p, DTensor):  # unsharded; a routed expert's is its EP slice (parallel.fsdp=false)
            return init.LocalRows(p.data, j * p.shape[0], p.shape[0] * ep) if name in experts else init.whole(name, p)
        local = p.to_local()
        rows = p.shape[0]
        start = _chunk_start(rows, p)
        if name in experts:  # p: the [L, ...] EP slice on the edp mesh
            return init.LocalRows(local, j * rows + start, rows * ep)
        return init.LocalRows(local, start, rows)

    return where


def build_model(cfg: ModelConfig, device: torch.device, seed: int, meshes: Meshes | None = None,
                parallel: ParallelConfig | None = None, fill: Fill | None = None,
                lora: LoRAConfig | None = None) -> tuple[MoEModel, list[str], dict[str, int]]:
    """The model of `cfg` on `device`, parallelised over `meshes` when given, each process holding
    and filling its own shards: by `fill` (a loader) or else with the initial weights of `seed`.
    With `lora` (train.lora) the model carries adapters: a `fill` writes the base (a loader knows
    nothing of adapters) and the adapters then take their initial weights of `seed`.
    Returns the model, the expert parameter names EP sharded, and the global parameter counts."""
    with torch.device("meta"):
        model = MoEModel(cfg, lora=lora)
    counts = model.num_params()
    names: list[str] = []
    if meshes is not None:
        names = parallelize_model(model, meshes, parallel or ParallelConfig(ep_size=meshes.mesh.size(1)))
    if parallel is not None:
        local_payload(model, parallel.dispatch_dtype)
    model.materialize(device)
    where = local_rows(meshes, names) if meshes is not None else init.whole
    if device.type == "meta":  # shapes only (tests and tracing): nothing to fill
        return model, names, counts
    with torch.no_grad():
        if fill is not None:
            fill(model, where)
            if model.lora is not None:
                model.init_weights(seed, where, only=lora_layers.is_adapter)
        else:
            model.init_weights(seed, where)
    if model.lora is not None:  # QLoRA: the frozen experts packed once filled (layers/frozen_base.py)
        pack_frozen_base(model, model.lora.base)
    return model, names, counts
