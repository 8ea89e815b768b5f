"""The process group and the device mesh of a run: torchrun's environment in, the (edp, ep) mesh out,
or with pipeline stages the (pp, edp, ep) mesh: ep innermost (inside a node), then edp, then pp.

Live objects (process groups), never config: `Meshes` is built once by the trainer and handed to
whatever needs the groups (parallelize.py, the collective watch, checkpoints).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def under_torchrun() -> bool:
    """Whether this process is a torchrun worker (torchrun sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device: torch.device) -> bool:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) for the trainer's device (device.py decides it: cuda:LOCAL_RANK
    under torchrun): NCCL on CUDA, gloo on the CPU, even where CUDA exists. Returns False (and does
    nothing) outside torchrun."""
    if dist.is_initialized():
        return True
    if not under_torchrun():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return True


@dataclass(frozen=True)
class Meshes:
    """The live meshes of one run (not config: holds process groups)."""

    mesh: DeviceMesh  # (edp, ep)
    dp: DeviceMesh  # 1-D, all ranks
    expert_ckpt: DeviceMesh  # (ep, edp): the global layout of the expert tensors, for checkpoints
    # two-level dispatch (parallel.ep_hierarchy "node"): this rank's (node group, rail group)
    ep_hier: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None

    @property
    def world(self) -> int:
        return self.dp.size()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("ep")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp.get_group()


def check_ep_in_node(ep_size: int, world: int, per_node: int) -> None:
    """An ep group is ep_size consecutive ranks, and torchrun numbers ranks node by node (rank =
    node * per_node + local rank), so the group stays inside one node when ep_size divides the node's
    process count. One spanning two nodes would send every all-to-all over the network: refused."""
    if world > per_node and ep_size > 1 and per_node % ep_size:
        raise ValueError(f"parallel.ep_size={ep_size} does not divide the {per_node} processes per node: "
                         "an expert-parallel group would span two nodes")


def check_layout(pp_size: int, ep_size: int, world: int, per_node: int) -> None:
    """The mesh's sizes fit `world` ranks of `per_node` processes per node (a ValueError naming the
    field): ep_size and pp_size x ep_size divide the world, and an ep group stays inside a node."""
    if world % ep_size:
        raise ValueError(f"parallel.ep_size={ep_size} does not divide the world size {world}")
    if world % (pp_size * ep_size):
        raise ValueError(f"parallel.pp_size={pp_size} x parallel.ep_size={ep_size} does not divide the world "
                         f"size {world}")
    check_ep_in_node(ep_size, world, per_node)


def build_meshes(ep_size: int, device_type: str, ep_node_size: int | None = None) -> Meshes:
    """The (edp, ep) mesh over the default group, on the trainer's device type ("cuda" or "cpu");
    ep_size must divide the world size. `ep_node_size` (parallel.ep_hierarchy "node"; 0 = this
    node's process count): an ep group may then span nodes, and the two-level dispatch's groups are
    built (`ep_hier_groups`)."""
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # a two-level dispatch crosses nodes once per destination node: a group spanning nodes is its point
    check_layout(1, ep_size, world, world if ep_node_size is not None else per_node)
    dev = device_type
    mesh = init_device_mesh(dev, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
    dp = init_device_mesh(dev, (world,), mesh_dim_names=("dp",))
    expert_ckpt = DeviceMesh(dev, mesh.mesh.t().contiguous(), mesh_dim_names=("ep", "edp"))
    hier = None
    if ep_node_size is not None:
        hier = ep_hier_groups(ep_size, min(ep_node_size or per_node, ep_size), dev)
    return Meshes(mesh, dp, expert_ckpt, hier)


@dataclass(frozen=True)
class PipelineMeshes:
    """The live meshes of a run with pipeline stages: `stage` is this rank's stage replicas' own
    `Meshes` (its (edp, ep) mesh and the dp mesh over those edp x ep ranks), which EP and FSDP2
    use exactly as without stages; `pp` is the pipeline this rank belongs to (the ranks with the same
    (edp, ep) index, one per stage), which the schedule sends activations over."""

    stage: Meshes
    pp: DeviceMesh  # 1-D

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.pp.get_group()


def build_pipeline_meshes(pp_size: int, ep_size: int, device_type: str) -> PipelineMeshes:
    """The (pp, edp, ep) mesh over the default group: rank = (p * edp + i) * ep + j. pp_size x ep_size
    must divide the world size."""
    world = dist.get_world_size()
    check_layout(pp_size, ep_size, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    dev, edp = device_type, world // (pp_size * ep_size)
    m3 = init_device_mesh(dev, (pp_size, edp, ep_size), mesh_dim_names=("pp", "edp", "ep"))
    # every rank builds the same global meshes (group creation is collective), then takes its slice
    flat = DeviceMesh(dev, m3.mesh.reshape(pp_size, edp * ep_size), mesh_dim_names=("pp", "dp"))
    ckpt = DeviceMesh(dev, m3.mesh.transpose(1, 2).contiguous(), mesh_dim_names=("pp", "ep", "edp"))
    stage = Meshes(m3["edp", "ep"], flat["dp"], ckpt["ep", "edp"])
    return PipelineMeshes(stage, flat["pp"])


def ep_hier_groups(ep_size: int, node_size: int, device_type: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(node group, rail group) of this rank for a two-level dispatch (distributed/ep_hier.py) over the
    (edp, ep) layout: the ep ranks of one data-parallel replica split into ep_size / node_size nodes of
    node_size consecutive ranks; a rank's node group is its node's, its rail the ranks of the same
    index in every node. Collective: every rank of the default group calls it."""
    world = dist.get_world_size()
    if node_size < 1 or ep_size % node_size or world % ep_size:
        raise ValueError(f"parallel.ep_node_size={node_size}: must divide parallel.ep_size={ep_size}, "
                         f"which must divide the world size {world}")
    m = init_device_mesh(device_type, (world // ep_size, ep_size // node_size, node_size),
                         mesh_dim_names=("edp", "rail", "node"))
    return m.get_group("node"), m.get_group("rail")
