"""Differentiable all-to-all over an explicit process group.

Legend: N rows sent by this rank, M rows received, ... trailing dims travel untouched.

Two variants, both thin autograd wrappers around `torch.distributed.all_to_all_single` (gloo on CPU,
NCCL on GPU; no transport of our own):
- `all_to_all`: variable splits. Row block i of the input goes to rank i; block j of the output comes
  from rank j. The split sizes are Python ints, so a caller that learns them from the device pays one
  host sync (the EP dispatcher reads all of its sizes in one go, once per layer call).
- `all_to_all_fixed`: every rank sends N/P rows to every rank; no split sizes, no host sync.

The backward of an all-to-all is the reverse all-to-all with input and output splits swapped: the
gradient of a received row goes back to the rank that sent the row, to the row it came from. Nothing is
summed, so gradients are bit-exact copies.

The process group is always an argument: no module-level default group, no singleton.

Watching (distributed/watch.py): inside a trainer step run under `CommWatch.step`, every collective
here goes through the step's watch (timed, fingerprinted, explained on a timeout); the autograd
function keeps the forward's watch for its backward. Outside a watched step the calls are plain.
`all_reduce` is the same for the trainer's data-parallel reductions.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import watch as _watch

_CURRENT = object()  # "the watch of the running step" (a backward passes the forward's explicitly)


def _exchange(x: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
              group: ProcessGroup | None, zero_row: bool = False, watch: object = _CURRENT) -> torch.Tensor:
    x = x.contiguous()
    rows = sum(out_splits) if out_splits is not None else x.shape[0]
    out = x.new_empty((rows + zero_row, *x.shape[1:]))
    if zero_row:
        out[rows:].zero_()
    outs = None if out_splits is None else list(out_splits)
    ins = None if in_splits is None else list(in_splits)
    w = _watch.current() if watch is _CURRENT else watch
    if w is None:
        dist.all_to_all_single(out[:rows], x, output_split_sizes=outs, input_split_sizes=ins, group=group)
    else:
        w.run("all_to_all", group, x, lambda: dist.all_to_all_single(
            out[:rows], x, output_split_sizes=outs, input_split_sizes=ins, group=group),
            splits=None if outs is None else (outs, ins))
    return out


def all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: ProcessGroup | None) -> None:
    """`dist.all_reduce` in place, through the running step's watch when there is one."""
    w = _watch.current()
    if w is None:
        dist.all_reduce(t, op=op, group=group)
    else:
        w.run("all_reduce", group, t, lambda: dist.all_reduce(t, op=op, group=group))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
                group: ProcessGroup | None, zero_row: bool) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.zero_row = (out_splits, in_splits), group, zero_row
        ctx.watch = _watch.current()
        return _exchange(x, out_splits, in_splits, group, zero_row, ctx.watch)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        if ctx.zero_row:
            grad = grad[:-1]
        return _exchange(grad, in_splits, out_splits, ctx.group, watch=ctx.watch), None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group: ProcessGroup | None, zero_row: bool = False) -> torch.Tensor:
    """Send rows `x[sum(in_splits[:i]) : sum(in_splits[:i+1])]` to rank i; receive `out_splits[j]`
    rows from rank j, concatenated in rank order. Differentiable. `zero_row` appends one zero row
    to the output (allocated with it, so a gather can point unused slots there without a copy)."""
    return _AllToAll.apply(x, tuple(out_splits), tuple(in_splits), group, zero_row)


def all_to_all_fixed(x: torch.Tensor, group: ProcessGroup | None, zero_row: bool = False) -> torch.Tensor:
    """Equal splits: x has P blocks of N/P rows, block i goes to rank i. Differentiable, sync-free."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"all_to_all_fixed: {x.shape[0]} rows do not split evenly over {world} ranks")
    return _AllToAll.apply(x, None, None, group, zero_row)
