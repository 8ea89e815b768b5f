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

Ring dispatch (ep_ring.py): `all_gather_rows` (every rank's rows to every rank; its backward sums the
gradients of my rows over the ranks, a reduce-scatter) and `reduce_scatter_rows` (block r summed
over the ranks to rank r; its backward gathers). Both use the single-tensor collectives
(`all_gather_single`, `reduce_scatter_single`), which gloo and NCCL implement.

Payload (`payload`, ops/payload.py; the EP dispatcher's `parallel.dispatch_dtype`): the forward
encodes the rows it sends (mxfp8 / fp8 blockwise codes and scales as uint8, or bf16), exchanges
those, and decodes what it receives into the rows' dtype. The backward sends the gradient back in
bf16 (the encoding's own gradient is the identity), so a low-precision payload halves an fp32
gradient's trip too; `native` sends it in the rows' dtype as before. The appended zero row
is a row of zero bytes, which every payload decodes to zeros.

Traceable exchanges (parallel.ep_capturable) are comm_traced.py's: torch's functional collectives.

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

from ..ops import payload as _payload
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


def _grad_wire(g: torch.Tensor, payload: str) -> torch.Tensor:
    """The gradient as it travels back: bf16 under a low-precision payload, else as it is."""
    return g if payload == "native" else g.to(torch.bfloat16)


class Pending:
    """An all-to-all in flight between `all_to_all_start` and `all_to_all_wait` (one use each way)."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None  # the start's output (autograd-tracked)
        self.wait: Callable[[], None] | None = None  # the forward exchange's wait
        self.back: tuple[torch.Tensor, Callable[[], None]] | None = None  # the reverse one's (grad, wait)
        self.args: tuple = ()  # (out_splits, in_splits, group, zero_row), for the wait
        self.payload: str = "native"
        self.received: torch.Tensor | None = None  # a coded payload's receive buffer (uint8)
        self.row: tuple[int, torch.dtype] = (0, torch.float32)  # (D, dtype) the rows decode to


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
                group: ProcessGroup | None, zero_row: bool, pend: Pending) -> torch.Tensor:
        ctx.pend = pend
        if pend.payload == "native":
            out, pend.wait = _exchange_start(x, out_splits, in_splits, group, zero_row, _watch.current())
            return out
        wire = _payload.encode(x, pend.payload)
        pend.received, pend.wait = _exchange_start(wire, out_splits, in_splits, group, zero_row, _watch.current())
        pend.row = (x.shape[1], x.dtype)
        # what autograd carries to the wait: the rows' shape and dtype; the wait decodes into a new tensor
        return x.new_empty((pend.received.shape[0], x.shape[1]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, wait = ctx.pend.back  # issued by _Wait.backward; `grad` is the same tensor, ignored
        ctx.pend.back = None
        wait()
        return g.to(grad.dtype), None, None, None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
                group: ProcessGroup | None, zero_row: bool, pend: Pending) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.zero_row, ctx.pend = (out_splits, in_splits), group, zero_row, pend
        ctx.watch = _watch.current()
        pend.wait()
        pend.wait = None
        if pend.payload == "native":
            return out.view_as(out)
        received, pend.received = pend.received, None
        return _payload.decode(received, pend.payload, *pend.row)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        g = _grad_wire(grad[:-1] if ctx.zero_row else grad, ctx.pend.payload)
        ctx.pend.back = _exchange_start(g, in_splits, out_splits, ctx.group, False, ctx.watch)
        return grad, None, None, None, None, None


def all_to_all_start(x: torch.Tensor, out_splits: Sequence[int] | None, in_splits: Sequence[int] | None,
                     group: ProcessGroup | None, zero_row: bool = False, payload: str = "native") -> Pending:
    """Issue `all_to_all` (splits given) or `all_to_all_fixed` (both None); read the result with
    `all_to_all_wait`, after computing something else. Differentiable (module note)."""
    if out_splits is None and x.shape[0] % dist.get_world_size(group):
        raise ValueError(f"all_to_all_start: {x.shape[0]} rows do not split evenly over "
                         f"{dist.get_world_size(group)} ranks")
    pend = Pending()
    pend.payload = payload
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
                group: ProcessGroup | None, zero_row: bool, payload: str) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.zero_row, ctx.payload = (out_splits, in_splits), group, zero_row, payload
        ctx.watch = _watch.current()
        if payload == "native":
            return _exchange(x, out_splits, in_splits, group, zero_row, ctx.watch)
        received = _exchange(_payload.encode(x, payload), out_splits, in_splits, group, zero_row, ctx.watch)
        return _payload.decode(received, payload, x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        dtype = grad.dtype
        if ctx.zero_row:
            grad = grad[:-1]
        g = _exchange(_grad_wire(grad, ctx.payload), in_splits, out_splits, ctx.group, watch=ctx.watch)
        return g.to(dtype), None, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group: ProcessGroup | None, zero_row: bool = False, payload: str = "native") -> torch.Tensor:
    """Send rows `x[sum(in_splits[:i]) : sum(in_splits[:i+1])]` to rank i; receive `out_splits[j]`
    rows from rank j, concatenated in rank order. Differentiable. `zero_row` appends one zero row
    to the output (allocated with it, so a gather can point unused slots there without a copy).
    `payload`: the rows' encoding on the wire (module note; rows [N, D] only)."""
    return _AllToAll.apply(x, tuple(out_splits), tuple(in_splits), group, zero_row, payload)


def all_to_all_fixed(x: torch.Tensor, group: ProcessGroup | None, zero_row: bool = False,
                     payload: str = "native") -> torch.Tensor:
    """Equal splits: x has P blocks of N/P rows, block i goes to rank i. Differentiable, sync-free."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"all_to_all_fixed: {x.shape[0]} rows do not split evenly over {world} ranks")
    return _AllToAll.apply(x, None, None, group, zero_row, payload)


def _collective(op: str, x: torch.Tensor, group: ProcessGroup | None, watch: object, issue: Callable[[], object]) -> None:
    w = _watch.current() if watch is _CURRENT else watch
    if w is None:
        issue()
    else:
        w.run(op, group, x, issue)


def _gather(x: torch.Tensor, group: ProcessGroup | None, watch: object) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _collective("all_gather", x, group, watch, lambda: dist.all_gather_single(out, x, group=group))
    return out


def _scatter_sum(y: torch.Tensor, group: ProcessGroup | None, watch: object) -> torch.Tensor:
    y = y.contiguous()
    out = y.new_empty((y.shape[0] // dist.get_world_size(group), *y.shape[1:]))
    _collective("reduce_scatter", y, group, watch, lambda: dist.reduce_scatter_single(out, y, group=group))
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup | None, payload: str) -> torch.Tensor:
        ctx.group, ctx.payload, ctx.watch = group, payload, _watch.current()
        if payload == "native":
            return _gather(x, group, ctx.watch)
        received = _gather(_payload.encode(x, payload), group, ctx.watch)
        return _payload.decode(received, payload, x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every rank's gradient for my rows, summed: the adjoint of the gather
        return _scatter_sum(_grad_wire(grad, ctx.payload), ctx.group, ctx.watch).to(grad.dtype), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group, ctx.watch = group, _watch.current()
        return _scatter_sum(y, group, ctx.watch)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.group, ctx.watch), None


def all_gather_rows(x: torch.Tensor, group: ProcessGroup | None, payload: str = "native") -> torch.Tensor:
    """Every rank's rows, in rank order ([P * N, ...]; every rank passes N rows). Differentiable: the
    backward sums every rank's gradient of my rows (a reduce-scatter). `payload`: the rows' encoding
    on the wire, as for `all_to_all` (rows [N, D] only)."""
    return _AllGather.apply(x, group, payload)


def reduce_scatter_rows(y: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Block r of `y` ([P * N, ...]) summed over the ranks, to rank r. Differentiable (the backward is
    the gather of the gradient). The sum runs in y's dtype, in the backend's order."""
    return _ReduceScatter.apply(y, group)
