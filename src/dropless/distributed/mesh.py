"""The process group and the device mesh of a run: torchrun's environment in, the (edp, ep) mesh out.

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


def build_meshes(ep_size: int, device_type: str) -> Meshes:
    """The (edp, ep) mesh over the default group, on the trainer's device type ("cuda" or "cpu");
    ep_size must divide the world size."""
    world = dist.get_world_size()
    if world % ep_size:
        raise ValueError(f"parallel.ep_size={ep_size} does not divide the world size {world}")
    check_ep_in_node(ep_size, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    dev = device_type
    mesh = init_device_mesh(dev, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
    dp = init_device_mesh(dev, (world,), mesh_dim_names=("dp",))
    expert_ckpt = DeviceMesh(dev, mesh.mesh.t().contiguous(), mesh_dim_names=("ep", "edp"))
    return Meshes(mesh, dp, expert_ckpt)
