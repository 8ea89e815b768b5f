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

Overlap (`all_to_all_start` / `all_to_all_wait`): the same exchange split into issue and wait, so a
caller computes something else while it is in flight (the EP dispatcher runs the shared experts
there). Two autograd functions: the start's forward issues (`async_op=True`) and returns the output
buffer, not yet filled; the wait's forward waits and hands it on. In the backward the order reverses:
the wait's backward issues the reverse exchange, the start's backward waits for it, and what the
autograd engine runs in between (it runs nodes newest first: the nodes created between the start and
the wait, i.e. the overlapped computation's backward) overlaps it too. The same collectives on the
same data as the blocking path: outputs and gradients are bit-identical (tests/distributed/
test_ep_overlap.py). Both go through the watch (`CommWatch.run_async`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import watch as _watch

_CURRENT = object()  # "the watch of the running step" (a backward passes the forward's explicitly)


def _buffers(x: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
             zero_row: bool) -> tuple[torch.Tensor, torch.Tensor, int, list[int] | None, list[int] | None]:
    """(contiguous x, the receive buffer, rows received, out splits, in splits) of one exchange; the
    buffer has one extra zero row when `zero_row` (padding rows gather it)."""
    x = x.contiguous()
    rows = sum(out_splits) if out_splits is not None else x.shape[0]
    out = x.new_empty((rows + zero_row, *x.shape[1:]))
    if zero_row:
        out[rows:].zero_()
    outs = None if out_splits is None else list(out_splits)
    ins = None if in_splits is None else list(in_splits)
    return x, out, rows, outs, ins


def _exchange(x: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
              group: ProcessGroup | None, zero_row: bool = False, watch: object = _CURRENT) -> torch.Tensor:
    x, out, rows, outs, ins = _buffers(x, out_splits, in_splits, zero_row)
    w = _watch.current() if watch is _CURRENT else watch
    if w is None:
        dist.all_to_all_single(out[:rows], x, output_split_sizes=outs, input_split_sizes=ins, group=group)
    else:
        w.run("all_to_all", group, x, lambda: dist.all_to_all_single(
            out[:rows], x, output_split_sizes=outs, input_split_sizes=ins, group=group),
            splits=None if outs is None else (outs, ins))
    return out


def _exchange_start(x: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
                    group: ProcessGroup | None, zero_row: bool, watch: object) -> tuple[torch.Tensor, Callable[[], None]]:
    """`_exchange` issued with async_op=True: (the output, filled once the returned wait has run)."""
    x, out, rows, outs, ins = _buffers(x, out_splits, in_splits, zero_row)

    def issue() -> Any:
        return dist.all_to_all_single(out[:rows], x, output_split_sizes=outs, input_split_sizes=ins,
                                      group=group, async_op=True)
    if watch is None:
        return out, issue().wait
    splits = None if outs is None else (outs, ins)
    return out, watch.run_async("all_to_all", group, x, issue, splits=splits)


class Pending:
    """An all-to-all in flight between `all_to_all_start` and `all_to_all_wait` (one use each way)."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None  # the start's output (autograd-tracked)
        self.wait: Callable[[], None] | None = None  # the forward exchange's wait
        self.back: tuple[torch.Tensor, Callable[[], None]] | None = None  # the reverse one's (grad, wait)
        self.args: tuple = ()  # (out_splits, in_splits, group, zero_row), for the wait


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
                group: ProcessGroup | None, zero_row: bool, pend: Pending) -> torch.Tensor:
        ctx.pend = pend
        out, pend.wait = _exchange_start(x, out_splits, in_splits, group, zero_row, _watch.current())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, wait = ctx.pend.back  # issued by _Wait.backward; `grad` is the same tensor, ignored
        ctx.pend.back = None
        wait()
        return g, None, None, None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
                group: ProcessGroup | None, zero_row: bool, pend: Pending) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.zero_row, ctx.pend = (out_splits, in_splits), group, zero_row, pend
        ctx.watch = _watch.current()
        pend.wait()
        pend.wait = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        g = grad[:-1] if ctx.zero_row else grad
        ctx.pend.back = _exchange_start(g, in_splits, out_splits, ctx.group, False, ctx.watch)
        return grad, None, None, None, None, None


def all_to_all_start(x: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
                     group: ProcessGroup | None, zero_row: bool = False) -> Pending:
    """Issue `all_to_all` (splits given) or `all_to_all_fixed` (both None); read the result with
    `all_to_all_wait`, after computing something else. Differentiable (module note)."""
    if out_splits is None and x.shape[0] % dist.get_world_size(group):
        raise ValueError(f"all_to_all_start: {x.shape[0]} rows do not split evenly over "
                         f"{dist.get_world_size(group)} ranks")
    pend = Pending()
    splits = (None if out_splits is None else tuple(out_splits), None if in_splits is None else tuple(in_splits))
    pend.out = _Start.apply(x, *splits, group, zero_row, pend)
    pend.args = (*splits, group, zero_row)
    return pend


def all_to_all_wait(pend: Pending) -> torch.Tensor:
    """The received rows of a started all-to-all (waits for it)."""
    return _Wait.apply(pend.out, *pend.args, pend)


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
