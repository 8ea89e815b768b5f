"""A pipelined step's gradients: the embedding's two copies summed, the global norm and clipping.

The last stage holds a copy of `embed.weight` with tied embeddings (the head's weight) or with
multi-token prediction (what the MTP modules embed with; pipeline_stage.py). With the first and last
stage on different ranks its gradient is summed over the two ranks of each pipeline (`tie_group`),
so both copies take the same update. The global norm (as parallelize.finish_grads_): every rank's
squared local shards summed once over all ranks (stages, ep slices and dp shards are disjoint pieces
of the model; the embedding counted on the first stage's ranks only), the expert gradients divided
by ep (they carry every ep rank's loss gradient), the clip factor clip_grad_norm_'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..pipeline_config import PipelineSpec


def tie_group(spec: PipelineSpec) -> dist.ProcessGroup | None:
    """The two ranks of each pipeline holding the first and the last stage (every rank takes part
    in creating every group; None where one rank holds both, or this rank holds neither)."""
    owner = {s: p for p in range(spec.pp_size) for s in spec.stages_of(p)}
    first, last = owner[0], owner[spec.num_stages - 1]
    if first == last:
        return None
    mine = None
    world = dist.get_world_size()
    ranks = torch.arange(world).reshape(spec.pp_size, world // spec.pp_size)  # mesh.py's order
    for d in range(ranks.shape[1]):
        pair = [int(ranks[first, d]), int(ranks[last, d])]
        g = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = g
    return mine


@torch.no_grad()
def sync_tied_grads(pipe) -> None:  # noqa: ANN001  (a pipeline.Pipeline, which imports this module)
    """The embedding's gradient summed over the first and the last stage's copies (module note)."""
    if pipe.tied_group is None:
        return
    w = next(m.embed.weight for m in pipe.modules if m.embed is not None)
    g = w.grad
    if g is None:  # (a stage whose loss never reached the embedding still takes part)
        w.grad = g = torch.zeros_like(w)
    dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=pipe.tied_group)


@torch.no_grad()
def clip_grad_norm_(pipe, max_norm: float) -> torch.Tensor:  # noqa: ANN001  (a pipeline.Pipeline)
    """The global gradient norm over every rank's shards, and the gradients scaled to `max_norm`
    when it is > 0 (clip_grad_norm_'s rule); returns the norm. As parallelize.finish_grads_: the
    expert gradients carry every ep rank's loss gradient, so they are divided by ep (in the norm
    and in the one multiply); the embedding counts once (on the first stage's ranks)."""
    experts = set(pipe.expert_names)
    skip_tied = pipe.tied_group is not None and not pipe.has_first
    dense, expert = [], []
    for name, p in pipe.named_parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            (expert if name in experts else dense).append((name, g))
    sq_dense = torch.zeros((), dtype=torch.float32, device=pipe.device)
    sq_expert = torch.zeros((), dtype=torch.float32, device=pipe.device)
    for name, g in dense:
        if not (skip_tied and name == "embed.weight"):
            sq_dense += g.float().square().sum()
    for _, g in expert:
        sq_expert += g.float().square().sum()
    sq = sq_dense + sq_expert / (pipe.ep * pipe.ep)
    dist.all_reduce(sq)  # every rank: stages, ep slices and dp shards are disjoint pieces of the model
    norm = sq.sqrt()
    coef = torch.ones((), dtype=torch.float32, device=pipe.device)
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if dense:
        torch._foreach_mul_([g for _, g in dense], coef)
    if expert:
        torch._foreach_mul_([g for _, g in expert], coef / pipe.ep)
    return norm
