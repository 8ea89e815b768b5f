"""Where a run lives: its device and dtype, its processes, and the model placed on them.

`build_layout` decides once, before anything is built: the placement (device.py: device, autocast
dtype, and why), the process facts (rank, world size; a process group is initialised beforehand,
e.g. by torchrun), the CPU threads, determinism and the global seed. `place_model` then builds the
model on the meta device, parallelises it there under several processes (distributed/parallelize.py:
EP, then FSDP2), and has each rank allocate its own shards on the device and fill them
(distributed/materialize.py): the initial weights of `train.seed` (the same values at every world
size and layout) or `init_weights`, a loader that writes each rank's rows (e.g. a Hugging Face
checkpoint read slice by slice); then the collective watch and the hot-expert replicas that follow
from the mesh.

The layout also says how a step's gradients are finished: over the mesh (the expert gradients
divided by the EP size, one global norm), all-reduced first without FSDP2 (`parallel.fsdp = false`,
distributed/replicated.py), or, in one process, plain clipping.

Pipeline stages (`parallel.pp_size` > 1, distributed/pipeline.py): the (pp, edp, ep) mesh; this rank
builds, parallelises and fills only its stages, and the trainer holds them as one `PipelineModel`
under the model's names. The data-parallel index and size (`dp_rank`, `dp_world`) are then those of
the stage's replicas: every rank of a pipeline draws the same batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .. import device as devices
from ..config import ParallelConfig, RunConfig
from ..device import Placement
from ..distributed import parallelize as par
from ..distributed import replicated
from ..distributed.materialize import Fill, build_model
from ..distributed.mesh import Meshes, build_meshes, build_pipeline_meshes
from ..distributed.pipeline import Pipeline
from ..distributed.pipeline_model import PipelineModel
from ..distributed.watch import CommWatch, build_watch
from ..model import MoEModel
from .ep_replicas_train import HotReplicas

AllReduce = Callable[[torch.Tensor, str], None]  # (tensor, "sum" | "max"), in place, over the dp ranks


@dataclass
class Layout:
    placement: Placement
    distributed: bool  # a process group is initialised (one process with one included)
    world_size: int
    rank: int
    parallel: ParallelConfig  # with its token bound filled in (buffered EP's fixed buffers)
    param_counts: dict[str, int] = field(default_factory=dict)  # before sharding: global counts
    meshes: Meshes | None = None  # None in one process
    expert_names: list[str] = field(default_factory=list)  # the EP-sharded parameters
    reduce: AllReduce | None = None  # in-place sum/max over the data-parallel ranks
    comm_watch: CommWatch | None = None  # None in one process
    replicas: HotReplicas | None = None  # parallel.replicate_hot_experts > 0
    pipeline: Pipeline | None = None  # parallel.pp_size > 1
    dp_world: int = 1  # the data-parallel ranks (world_size, or world_size / pp_size with stages)
    dp_rank: int = 0  # this rank's index among them

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def finish_grads(self, model: MoEModel, grad_clip: float) -> torch.Tensor:
        """After the step's backward passes: the global gradient norm (a device scalar), clipped to
        `grad_clip` unless 0."""
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm_(grad_clip)
        if self.meshes is not None and not self.parallel.fsdp:
            return replicated.finish_grads_(model, self.expert_names, self.meshes, grad_clip)
        if self.meshes is not None:
            return par.finish_grads_(model, self.expert_names, self.meshes.mesh.size(1), grad_clip,
                                     self.meshes.dp_group)
        if grad_clip > 0:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])


def build_layout(cfg: RunConfig, device: torch.device | str | None = None) -> Layout:
    """The placement and the process facts; seeds the global RNG (`train.seed`), which the model's
    initial weights draw from. `device` overrides `train.device`."""
    t = cfg.train
    backend = dist.get_backend() if dist.is_initialized() else None
    placement = devices.resolve(device if device is not None else t.device, t.dtype, backend)
    devices.activate(placement.device)
    if t.threads:
        torch.set_num_threads(t.threads)
    if t.deterministic:
        devices.deterministic(placement.device)
    torch.manual_seed(t.seed)
    distributed = dist.is_initialized()
    # buffered EP: the shared bound on a micro-batch's tokens; a replayed record's sequences are as
    # long as model.max_seq_len, not train.seq_len (data/replay.py)
    longest = cfg.model.max_seq_len if cfg.data.replay_routing else t.seq_len
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    dp_world = world // cfg.parallel.pp_size if world % cfg.parallel.pp_size == 0 else world
    return Layout(placement, distributed, world_size=world, rank=rank,
                  parallel=cfg.parallel.with_token_bound(t.batch_size * longest),
                  dp_world=dp_world, dp_rank=rank % dp_world)


def place_model(cfg: RunConfig, layout: Layout, init_weights: Fill | None = None,
                packed: bool = False) -> tuple[Layout, MoEModel]:
    """The model on the layout's device, parallelised over its processes; the layout returned with
    the mesh, the reduction, the watch and the replicas filled in. `packed`: the batches carry
    document ids (what pipeline stages must pass on)."""
    p = layout.parallel
    if not layout.distributed and p.ep_size > 1:
        raise ValueError(f"parallel.ep_size={p.ep_size}: expert parallelism needs several processes "
                         "(dropless train --nproc N, or torchrun -m dropless.train)")
    if p.pp_size > 1:
        return _place_pipeline(cfg, layout, init_weights, packed)
    # Built on the meta device, parallelised there, then each rank allocates and fills its own
    # shards (distributed/materialize.py): the initial weights are a function of (train.seed,
    # parameter name), the same at every world size and EP layout
    meshes = build_meshes(p.ep_size, layout.device.type, p.hier_node_size) if layout.distributed else None
    model, names, counts = build_model(cfg.model, layout.device, cfg.train.seed, meshes, p, init_weights,
                                       cfg.train.lora)
    layout = dataclasses.replace(layout, param_counts=counts)
    if meshes is not None:
        layout.meshes, layout.expert_names = meshes, names
        layout.reduce = par.dp_all_reduce(meshes.dp_group)
    layout.comm_watch = build_watch(layout.meshes, layout.device, p)
    layout.replicas = HotReplicas.build(model, layout.meshes, p, layout.device)  # before the guards
    return layout, model


def _place_pipeline(cfg: RunConfig, layout: Layout, init_weights: Fill | None,
                    packed: bool) -> tuple[Layout, PipelineModel]:
    """This rank's stages, parallelised inside and filled (module note)."""
    p = layout.parallel
    if not layout.distributed:
        raise ValueError(f"parallel.pp_size={p.pp_size}: pipeline stages need several processes "
                         "(dropless train --nproc N, or torchrun -m dropless.train)")
    if init_weights is not None:
        raise ValueError(f"--init-from with parallel.pp_size={p.pp_size}: loading weights into pipeline stages "
                         "is not supported yet; train one stage layout, or resume a checkpoint")
    meshes = build_pipeline_meshes(p.pp_size, p.ep_size, layout.device.type)
    with torch.device("meta"):
        whole = MoEModel(cfg.model)
    counts = whole.num_params()
    t = cfg.train
    pipe = Pipeline(whole, p.pipeline, meshes, p, layout.device, t.batch_size, t.seq_len, t.seed,
                    logits_dtype=layout.placement.autocast_dtype or torch.float32, packed=packed)
    model = PipelineModel(pipe, counts)
    layout = dataclasses.replace(layout, param_counts=counts, meshes=meshes.stage, expert_names=pipe.expert_names,
                                 reduce=par.dp_all_reduce(meshes.stage.dp_group), pipeline=pipe)
    layout.comm_watch = build_watch(layout.meshes, layout.device, p)
    return layout, model
