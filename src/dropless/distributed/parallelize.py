"""Parallelise a single-device `MoEModel` from outside: expert parallelism, then FSDP2 ("parallel folding").

Mesh layout. W ranks form a 2-D `DeviceMesh` of shape (edp, ep), names ("edp", "ep"), ep innermost:

    rank = i * ep + j        i in [0, edp): expert-data-parallel index;  j in [0, ep): EP index
    ep group of rank r:   the ep consecutive ranks of its row (on GPUs: inside one node, where the
                          all-to-all is cheapest)
    edp group of rank r:  the ranks with the same j (they hold the same experts)
    dp:                   a 1-D mesh over all W ranks, for everything that is not a routed expert

Order (each step assumes the one before):
1. EP: every MoE layer keeps its ep-slice of the stacked expert weights (`shard_moe_layer`: rank
   (i, j) keeps experts [j*L, (j+1)*L), L = E/ep) and gets an `EPDispatcher` over the ep group.
   E not divisible by ep is a ValueError.
2. FSDP2 on the experts over the edp mesh: the L local experts are sharded, gathered and
   reduce-scattered among the edp ranks that hold the same experts. FSDP divides their gradient by
   edp, but a local expert's gradient already sums the loss gradients of every rank in its ep group
   (the all-to-all backward brings them), so after the reduce-scatter it holds the sum over all W
   ranks divided by edp: `finish_grads_` divides it by ep once more to get the mean over ranks, as
   for dense weights. (FSDP's own `set_gradient_divide_factor(W)` would do it inside the
   reduce-scatter, but needs ReduceOp.PREMUL_SUM, which gloo lacks; one path for both backends.)
3. FSDP2 on each MoE layer's router over dp, as its own unit: the health monitor calls the router
   outside the model's forward (bf16 flip rate), which works on an FSDP unit of its own.
4. FSDP2 on each block over dp (attention, norms, dense MLPs, shared experts: the parameters the
   inner units do not already own), then on the root (embeddings, final norm, tied LM head).

With `parallel.fsdp = false` only step 1 is applied: every rank holds the whole dense model and its
EP slice of the experts as plain tensors (replicated.py finishes their gradients).

After this every parameter element lives on exactly one rank (dense: one of W dp shards; experts: one
ep slice, one of edp shards of it), which is what `grad_norm_` and the checkpoints rely on.

LoRA (train.lora): the routed experts' adapters have the experts' dim 0, so they are expert parameters
like the base (EP-sliced with their experts, FSDP-sharded over edp, in the names returned, their
gradients divided by ep and their checkpoints at the global [E, ...] shape). The frozen base shares
every FSDP unit with trainable parameters: FSDP2 reduce-scatters the gradients that exist, and
`finish_grads_` sees only those (tests/distributed/test_lora_ep.py).

Checkpoints see the experts through a third mesh, (ep, edp) over the same ranks (the transpose of
the training mesh): with placements (Shard(0), Shard(0)) it describes the global [E, ...] expert
tensor exactly as it is spread (ep slices first, edp chunks inside them), so a checkpoint written at one
(ep, edp) loads at another (`runs/dist_checkpoint.py`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ..config import ParallelConfig
from ..layers.moe import MoELayer
from ..model import MoEModel
from . import comm
from .ep import EPDispatcher
from .mesh import Meshes
from .parallelize_ep import shard_moe_layer


def parallelize_model(model: MoEModel, meshes: Meshes, cfg: ParallelConfig) -> list[str]:
    """Apply EP then FSDP2 to `model` in place (order in the module note). Returns the names of the
    expert parameters (sharded by EP), which checkpoints treat specially. `model` may also be one
    pipeline stage (pipeline_stage.py: its blocks a ModuleDict, its root the stage)."""
    ep = meshes.mesh.size(1)
    if cfg.ep_size != ep:
        raise ValueError(f"parallel.ep_size={cfg.ep_size}: the mesh has ep={ep}")
    cfg.check_experts(model.expert_slots().routed)
    # FSDP2 warns when a unit returns a view (an in-place op on it would skip the pre-backward hook).
    # Ours do (the MoE output `y.view(shape)`, grouped-GEMM outputs) and nothing modifies them in place:
    # the model and trainer only ever add out of place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP(GroupedExperts|Block|MoEModel|StageModel)\) "
                            r"returned a view tensor", category=UserWarning)
    expert_names = []
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            shard_moe_layer(module, meshes.ep_group, cfg, meshes.ep_hier)
            expert_names += [f"{name}.experts.{p}" for p, _ in module.experts.named_parameters()]
            if cfg.fsdp:
                fully_shard(module.experts, mesh=meshes.mesh["edp"])
                fully_shard(module.router, mesh=meshes.dp)
    if not cfg.fsdp:  # replicated (replicated.py): plain tensors, gradients all-reduced by the trainer
        return expert_names
    blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks
    for block in blocks:
        fully_shard(block, mesh=meshes.dp)
    fully_shard(model, mesh=meshes.dp)
    return expert_names


def dp_all_reduce(group: dist.ProcessGroup) -> Callable[[torch.Tensor, str], None]:
    """The `(tensor, "sum" | "max") -> None` in-place reduction TrainHealth takes."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def reduce(t: torch.Tensor, op: str) -> None:
        comm.all_reduce(t, ops[op], group)  # watched inside a trainer step (distributed/watch.py)

    return reduce


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def finish_grads_(model: MoEModel, expert_names: list[str], ep: int, max_norm: float,
                  group: dist.ProcessGroup) -> torch.Tensor:
    """After backward: divide the expert gradients by ep (module note, step 2), take the global
    gradient norm and clip to `max_norm` (0 = no clipping), all on the device; returns the norm.

    Every element lives on exactly one rank (module note), so the squared norm is the sum of the
    local shards' squares, all-reduced once. Parameters on different meshes (dense on dp, experts on
    edp) are why `torch.nn.utils.clip_grad_norm_` does not apply. The 1/ep scale is folded into the
    one multiply that clipping does anyway."""
    experts = set(expert_names)
    dense, expert = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (expert if name in experts else dense).append(_local(p.grad))
    grads = dense + expert
    dev = grads[0].device if grads else torch.device("cpu")
    sq_dense = torch.zeros((), dtype=torch.float32, device=dev)
    sq_expert = torch.zeros((), dtype=torch.float32, device=dev)
    for g in dense:
        sq_dense += g.float().square().sum()
    for g in expert:
        sq_expert += g.float().square().sum()
    sq = sq_dense + sq_expert / (ep * ep)
    comm.all_reduce(sq, dist.ReduceOp.SUM, group)
    norm = sq.sqrt()
    coef = torch.ones((), dtype=torch.float32, device=dev)
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # the same rule as clip_grad_norm_
    if dense:
        torch._foreach_mul_(dense, coef)
    if expert:
        torch._foreach_mul_(expert, coef / ep)
    return norm


@contextlib.contextmanager
def _dispatchers_replaced(model: MoEModel, replace: Callable[[EPDispatcher], EPDispatcher]) -> Iterator[None]:
    saved = [(layer, layer.dispatcher) for layer in model.all_moe_layers()]  # MTP's MoE blocks too
    for layer, d in saved:
        if isinstance(d, EPDispatcher):
            layer.dispatcher = replace(d)
    try:
        yield
    finally:
        for layer, d in saved:
            layer.dispatcher = d


def worst_case_dispatch(model: MoEModel) -> contextlib.AbstractContextManager[None]:
    """Inside: every buffered EP layer dispatches with worst-case buffers (never overflows). For the
    retry of an overflowing step and the health probe, whose results must not depend on the buffer
    size."""
    return _dispatchers_replaced(model, lambda d: d.worst_case() if d.mode == "buffered" else d)


def exact_dispatch(model: MoEModel) -> contextlib.AbstractContextManager[None]:
    """Inside: every EP layer dispatches in exact mode (any number of tokens per rank, never
    overflows). For sharded evaluation, where ranks may hold batches of different sizes."""
    return _dispatchers_replaced(model, lambda d: d.exact())  # a subclass's own (hot-expert replicas)
