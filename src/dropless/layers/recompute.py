"""Activation recompute that never re-routes.

Legend: T tokens (leading dims flattened), K experts per token.

`model.recompute` names the parts of a block whose activations are dropped after the forward and
recomputed in the backward (torch's non-reentrant checkpoint: the region's saved tensors are replaced
by its inputs, and the backward reruns the region to get them back):
    layer (alias full)  the whole block: norms, attention, the MLP or the MoE layer
    moe                 the MoE layer: router GEMM, dispatch, experts, combine, shared experts
    attn                the attention module (qkv, rotary, SDPA, output projection)
    norm                the block's two RMSNorms
    shared_experts      the MoE layer's shared-expert MLP (the layer checkpoints it itself)
    moe_act             the expert activation: what the lean experts (ops/lean_experts.py, the
                        default) always do, recomputing it from the kept pre-activation in their
                        backward; the name is accepted for Megatron-Core users and changes nothing
                        here (config.check_recompute refuses it where the experts are not lean:
                        low-precision recipes, the capacity layout, or together with `moe`)

Routing in the recompute. A recomputed MoE layer must compute exactly what its forward computed, or
the gradients belong to a different function. Rerunning the router would re-decide the experts: a
forced_balance layer would draw new ids, and anything that moved the expert bias or the router
between forward and backward would change the choice. So the forward records each MoE layer's ids
(`MoEOutput.ids_TK`) and the recompute passes them as replay ids (`MoELayer.forward(replay_ids=)`,
the routing-replay path): the router's logits are recomputed (a T*D*E GEMM, small beside the experts)
and the weights taken at the recorded ids by `routing.weights_at`. For token-choice top-k those are
the same operations on the same logits as `topk_route`'s weights (`_combine_weights`, whose inputs
are the unbiased scores, so the expert bias and the group mask never enter them): bit-identical.
The variable-count strategies (expert_choice, expert_threshold) and `norm_top_k` have weights that
the ids alone do not fix; config.check_recompute refuses them with `moe`/`layer`.

Under expert parallelism the recompute REPEATS the all-to-alls; it does not keep the dispatched rows.
A recomputed `moe` (or `layer`) region reruns router GEMM, dispatch (count exchange, rows and pair
metadata out; exact mode's one host read of the split sizes), experts and combine (rows back) in the
backward, with the forward's ids, so the same pairs go to the same ranks in the same order: the same
bits (tests/distributed/test_recompute_ep.py). Why not keep the dispatched rows: they are the largest
thing the MoE layer holds (about T*K*D per rank without de-dup), and dropping them is what `moe`
recompute is for; the price is the forward's trips once more in the backward, counted by `dropless
bench ep` (recompute_extra_bytes: +50% of the plain forward+backward data bytes). Why it is safe:
every rank reaches a recomputed region's first saved tensor at the same node of the same graph (the
ranks build the same graph in the same order), so they rerun the same collectives in the same order;
checkpoint's early stop ends a recompute after the region's last saved tensor, which comes after its
last all-to-all (the combine's bag sum and the losses save tensors) on every rank alike. Buffered mode
reruns with the same fixed buffers and the same ids, so the same pairs overflow and are dropped; the
dispatcher in place in the backward must be the forward's (the trainer's worst-case retry and exact
evaluation swap dispatchers around forward and backward together; a different one would give
checkpoint different saved shapes, which it refuses).

The losses and statistics come from the forward's outputs only: the recompute's own outputs are
discarded by the checkpoint (it keeps only the saved tensors it regenerates), so nothing is counted
twice. Recompute applies only when autograd records (`torch.is_grad_enabled()`) and not when decoding
with a KV cache (the cache append is a side effect that must not run twice).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
from torch.utils.checkpoint import checkpoint

Out = TypeVar("Out")


def modes_of(names: list[str]) -> frozenset[str]:
    """The config's names with `full` read as `layer` (config.check_recompute validated them)."""
    return frozenset("layer" if n == "full" else n for n in names)


def active(kv: object | None) -> bool:
    return kv is None and torch.is_grad_enabled()


def recomputed(fn: Callable[..., Out], *args: object) -> Out:
    """`fn(*args)`, its saved activations recomputed in the backward instead of kept."""
    return checkpoint(fn, *args, use_reentrant=False)


def recomputed_routed(fn: Callable[[torch.Tensor | None], Out], replay_ids: torch.Tensor | None,
                      ids_of: Callable[[Out], torch.Tensor | None]) -> Out:
    """`fn(replay_ids)` recomputed in the backward with the expert ids its forward chose.

    `ids_of(out)` reads the ids ([T, K], or None for a region without an MoE layer) from the forward's
    output; the recompute calls `fn(those ids)`. Given replay ids are used by both calls."""
    kept: list[torch.Tensor | None] = []

    def run() -> Out:
        if kept:  # the backward's recompute: replay the forward's choice
            return fn(kept[0])
        out = fn(replay_ids)
        ids = ids_of(out)
        kept.append(replay_ids if ids is None else ids.detach())
        return out

    return checkpoint(run, use_reentrant=False)
