"""Fixed-split exchanges on torch's functional collectives (`torch.distributed._functional_collectives`),
which torch.compile traces into the graph: no graph break, no host read (parallel.ep_capturable, the
precondition of a CUDA-graph capture of the EP step; comm.py has the eager, watched forms).

Legend: N rows sent by this rank (N/P to each of the P ranks), ... trailing dims travel untouched.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _fc
from torch.distributed import ProcessGroup


def all_to_all_traceable(x: torch.Tensor, group: ProcessGroup | None, zero_row: bool = False,
                         differentiable: bool = True, run: torch.Tensor | None = None) -> torch.Tensor:
    """`all_to_all_fixed` on torch's functional collectives, which dynamo traces into one graph (no
    graph break, no host read): the form a CUDA-graph capture of the EP step needs
    (parallel.ep_capturable). The same exchange and the same bits; the collective watch does not see
    it (a traced collective cannot call back into Python).

    `run` (a device bool, the same on every rank): the exchange under `torch.cond`, and when False a
    zero-filled buffer of the received shape instead, with no collective (the capturable spill's
    second trip, distributed/ep_spill.py: False only when every rank sends zeros, which is then
    exactly what the exchange would return). Its backward is the same cond on the gradient."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"all_to_all_traceable: {x.shape[0]} rows do not split evenly over {world} ranks")
    exchange = partial(_traced_exchange, group if group is not None else dist.group.WORLD, differentiable)
    # one tensor in, one out: torch's cond differentiates a branch whose outputs are all floats or
    # none needs a gradient (mixed outputs fail its backward in torch 2.13)
    x = x.contiguous()
    y = exchange(x) if run is None else torch.cond(run, exchange, torch.zeros_like, (x,))
    return torch.cat([y, y.new_zeros((1, *y.shape[1:]))]) if zero_row else y


def _traced_exchange(group: ProcessGroup, differentiable: bool, x: torch.Tensor) -> torch.Tensor:
    exchange = _fc.all_to_all_single_autograd if differentiable else _fc.all_to_all_single
    return _fc.wait_tensor(exchange(x, None, None, group))
