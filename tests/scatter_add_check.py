"""A check for the "no scatter-add" rule: record every accumulating write that runs inside
`record_colliding_accumulations()` (forward and backward alike) whose index sends two or more
contributions to the same output element.

Why not compare two runs: on CPU, `index_add_`, `scatter_add_`, `index_put_(accumulate=True)` and the
embedding backward add their contributions serially in index order, so two runs agree to the bit and
a scatter-add path passes any rerun test. On a GPU the same ops add with atomics, in whatever order the
threads arrive, and the fp32 sum changes from run to run. What distinguishes the two on any device is
the op and its index: an accumulating write is order-dependent exactly when two contributions land on
one element. A write with distinct targets (the router's `gather` backward scatters K distinct experts
per token) sums nothing and is deterministic everywhere, so it is allowed.

The check replays each accumulating op with ones into zeros (the same index, the same op) and counts
the elements that received more than one contribution. Accumulating ops it does not know how to
replay are reported as colliding, so a new kind of scatter cannot slip through unnoticed.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Every aten op that adds several source values into one destination element through an index.
ACCUMULATING = {
    "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
    "index_reduce", "index_reduce_", "index_put", "index_put_", "_index_put_impl_", "put", "put_",
    "embedding_dense_backward", "embedding_backward", "_embedding_bag_backward",
    "_embedding_bag_dense_backward", "_embedding_bag_sparse_backward",
    "_embedding_bag_per_sample_weights_backward", "bincount", "histc",
}


def _most(t: torch.Tensor) -> int:
    return int(t.max()) if t.numel() else 0


def _max_hits(name: str, args: tuple, kwargs: dict[str, Any]) -> int | None:
    """Most contributions any output element gets; 0 when the op does not accumulate (index_put
    without accumulate); None when the op is not modelled."""
    a = list(args)
    if name in ("index_add", "index_add_"):
        self, dim, index, src = a[:4]
        return _most(torch.zeros_like(self).index_add_(dim, index, torch.ones_like(src)))
    if name in ("scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"):
        self, dim, index = a[:3]
        ones = torch.ones(index.shape, dtype=self.dtype, device=self.device)
        return _most(torch.zeros_like(self).scatter_add_(dim, index, ones))
    if name in ("index_reduce", "index_reduce_"):
        self, dim, index = a[:3]
        ones = torch.ones(index.numel(), dtype=self.dtype, device=self.device)
        return _most(torch.zeros(self.shape[dim], device=self.device).index_add_(0, index, ones))
    if name in ("index_put", "index_put_", "_index_put_impl_"):
        accumulate = a[3] if len(a) > 3 else kwargs.get("accumulate", False)
        if not accumulate:
            return 0
        self, indices, values = a[:3]
        hits = torch.zeros(self.shape, dtype=torch.float32, device=self.device)
        return _most(hits.index_put_(indices, torch.ones((), device=self.device), accumulate=True))
    if name in ("put", "put_"):
        accumulate = a[3] if len(a) > 3 else kwargs.get("accumulate", False)
        if not accumulate:
            return 0
        return _most(torch.bincount(a[1].reshape(-1) % max(1, a[0].numel())))
    if name in ("embedding_dense_backward", "embedding_backward", "_embedding_bag_backward",
                "_embedding_bag_dense_backward", "_embedding_bag_sparse_backward"):
        indices = a[1]
        return _most(torch.bincount(indices.reshape(-1))) if indices.numel() else 0
    return None


@dataclass
class Collisions:
    found: list[str] = field(default_factory=list)


class _Recorder(TorchDispatchMode):
    def __init__(self, out: Collisions) -> None:
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ACCUMULATING:
            hits = _max_hits(name, args, kwargs)  # the mode is off in here: no recursion
            if hits is None or hits > 1:
                shapes = [tuple(x.shape) for x in args if isinstance(x, torch.Tensor)]
                self.out.found.append(f"{func} {shapes}: " + ("not modelled" if hits is None
                                                              else f"{hits} contributions to one element"))
        return func(*args, **kwargs)


@contextmanager
def record_colliding_accumulations() -> Iterator[Collisions]:
    """Collect the accumulating writes with colliding targets that run inside the block (the
    autograd engine runs CPU backward on the calling thread, so `.backward()` in the block counts)."""
    out = Collisions()
    with _Recorder(out):
        yield out
