"""Apply expert parallelism from outside to a MoE layer built for one device.

The model code stays single-device: `shard_moe_layer` keeps this rank's slice of the stacked expert
weights (rank r of the group owns experts [r*L, (r+1)*L), L = E/P) and installs an EPDispatcher built
by `build_ep_dispatcher` (the row alignment the experts declare, buffers sized from
`parallel.max_tokens_per_rank`). The router (all E experts' logits) and the shared experts stay whole
on every rank: they are replicated, and their gradients are summed over the data that each rank saw
by the data-parallel reduction.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..config import ParallelConfig
from ..layers.dispatch import LocalDispatcher
from ..layers.moe import MoELayer
from ..layers import lora
from .ep import build_ep_dispatcher
from .ep_hier import build_hier_dispatcher


def shard_moe_layer(layer: MoELayer, group: ProcessGroup | None,
                    cfg: ParallelConfig | None = None,
                    hier: tuple[ProcessGroup, ProcessGroup] | None = None) -> MoELayer:
    """Shard `layer`'s routed experts over `group` in place and return it. `hier`: the (node, rail)
    groups of a two-level dispatch (parallel.ep_hierarchy "node")."""
    cfg = cfg or ParallelConfig(ep_size=dist.get_world_size(group))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if cfg.ep_size != world:
        raise ValueError(f"parallel.ep_size={cfg.ep_size}: the EP group has {world} ranks")
    if layer.cfg.capacity_factor is not None:
        raise ValueError(f"model.moe.capacity_factor={layer.cfg.capacity_factor}: expert parallelism is "
                         "dropless; the capacity baseline is single-device only")
    slots = layer.slots.sharded(world)  # ValueError unless the group divides the routed experts
    L = slots.local
    experts = layer.experts
    # built first, so a refused configuration leaves the layer whole; the factory gives it the row
    # alignment the experts declare, as the local dispatcher has
    dispatcher = (build_hier_dispatcher(layer, cfg, group, hier) if cfg.ep_hierarchy == "node"
                  else build_ep_dispatcher(layer, cfg, group))
    with torch.no_grad():
        # the base and, under train.lora, the experts' adapters (layers/lora.py): they live with their experts
        for name in ("w_gate_up_EDF", "w_down_EFD", *(lora.EXPERT_ADAPTERS if lora.has_expert_adapters(experts) else ())):
            full = getattr(experts, name)
            local = full[rank * L:(rank + 1) * L].detach().clone()
            setattr(experts, name, nn.Parameter(local, requires_grad=full.requires_grad))
    layer.dispatcher, layer.slots = dispatcher, slots
    return layer


def local_payload(model: nn.Module, dispatch_dtype: str) -> None:
    """Give the MoE layers of `model` that stayed on one device (no EP) the payload's rounding
    (parallel.dispatch_dtype): their experts then see the rows an EP destination would receive, so
    the same config trains the same numbers at every EP size."""
    for module in model.modules():
        if isinstance(module, MoELayer) and isinstance(module.dispatcher, LocalDispatcher):
            module.dispatcher = replace(module.dispatcher, payload=dispatch_dtype)
