"""The replicated layout (`parallel.fsdp = false`): expert parallelism without FSDP2, its gradients
finished on torch's functional collectives, so the whole step traces into graphs.

Why it exists: FSDP2's hooks are marked by torch as not to be traced (`torch._dynamo.disable`), so a
model under `fully_shard` cannot be one graph, and `train.compile = "step"` could not run across
processes. Without FSDP2 every rank holds the whole dense model (attention, norms, dense MLPs, shared
experts, router, embeddings) and its EP slice of the routed experts, [L, ...] of [E, ...]
(parallelize.py step 1 only), as plain tensors. The cost is memory: the dense weights, their
gradients and their optimizer state on every rank (FSDP2 holds 1/W of them).

The gradients after backward, on W = edp * ep ranks:
- dense: each rank's gradient of its own micro-batch; the mean over the W ranks is an all-reduce (sum)
  over dp, divided by W. Every rank then holds the same gradient and takes the same update.
- routed experts: the EP all-to-all's backward has already summed, into rank (i, j)'s local experts, the
  gradients of every rank of its ep group; the edp ranks with the same experts add theirs (an
  all-reduce over edp, skipped at edp 1) and the sum over all W ranks is divided by W.
Each reduction is one all-reduce of the gradients of one dtype laid end to end (one flat buffer, so a
handful of collectives per step, not one per parameter).

The global norm counts each element once: the dense part is the same on every rank (counted from one
rank's copy), and the routed part sums every ep slice once: each rank all-reduces
`sq_dense / W + sq_expert / edp` over dp, since W copies of the first and edp copies of each slice of
the second add up to the one model's squares. Clipping multiplies both by the same coefficient
(clip_grad_norm_'s rule).

Numerics: the all-reduce sums in the backend's order, as FSDP2's reduce-scatter does, so a run in
this layout equals the FSDP2 layout at the fp32 noise floor, not bit for bit (tolerances
PARALLEL_TRAIN_LOSS). No host read: the norm stays on the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _fc
from torch import nn

from .mesh import Meshes


def _all_reduce_sum_(grads: list[torch.Tensor], group: dist.ProcessGroup, scale: float) -> None:
    """grads[i] <- (sum over `group` of grads[i]) * scale, in place; one collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        flat = _fc.wait_tensor(_fc.all_reduce(flat, "sum", group)) * scale
        parts = torch.split(flat, [g.numel() for g in same])
        torch._foreach_copy_(same, [part.view(g.shape) for part, g in zip(parts, same)])


@torch.no_grad()
def finish_grads_(model: nn.Module, expert_names: list[str], meshes: Meshes, max_norm: float) -> torch.Tensor:
    """After backward: the mean gradient over the W ranks in every parameter (module note), the
    global norm (returned, a device scalar) and clipping to `max_norm` unless 0."""
    experts = set(expert_names)
    dense, expert = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            (expert if name in experts else dense).append(p.grad)
    W, edp = meshes.world, meshes.mesh.size(0)
    if dense:
        _all_reduce_sum_(dense, meshes.dp_group, 1.0 / W)
    if expert and edp > 1:
        _all_reduce_sum_(expert, meshes.mesh.get_group("edp"), 1.0 / W)
    elif expert:
        torch._foreach_mul_(expert, 1.0 / W)
    dev = (dense + expert)[0].device if dense or expert else torch.device("cpu")
    sq_dense = sum((g.float().square().sum() for g in dense), torch.zeros((), device=dev))
    sq_expert = sum((g.float().square().sum() for g in expert), torch.zeros((), device=dev))
    sq = _fc.wait_tensor(_fc.all_reduce(sq_dense / W + sq_expert / edp, "sum", meshes.dp_group))
    norm = sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # the same rule as clip_grad_norm_
        if dense or expert:
            torch._foreach_mul_(dense + expert, coef)
    return norm
