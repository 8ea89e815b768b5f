"""EP buffered mode, trainer side: a step whose pairs did not all fit is never applied.

Buffered expert parallelism (docs/ep.md) drops the pairs that overflow a fixed per-link buffer and
counts them on the device. The trainer turns the count into a policy, without a host sync per step
unless it must:

- Counting: per step, the dropped pairs of every layer and micro-batch are summed and all-reduced over
  the data-parallel group (so every rank agrees), with the largest per-link demand (max). Device only.
- Skip (`retry_on_overflow=false`): the optimizer update of an overflowing step is undone on the
  device. Design: before `optimizer.step()` the parameters and optimizer state (the local shards)
  are copied; after it, each is set to `where(invalid, copy, new)`. Zeroing the gradients is not a
  skip: AdamW still decays the weights, moves both moments and counts the step. A device-side flag
  inside the optimizer would avoid the copy but means owning the optimizer's kernel (fused or
  foreach); the copy costs one extra set of (parameters + optimizer state) per rank, in buffered
  mode only, and is exact for any optimizer whose state is tensors. The state is created eagerly
  (zero moments, step 0, what AdamW's first step creates), so a skipped first step restores it too.
- Check: every `overflow_check_every` steps (and before each checkpoint and at the end) the host
  reads the counters (one sync) and raises `EPOverflowError` with the observed demand and the
  configured capacity. Between checks the skipped steps cost nothing but their compute.
- Retry (`retry_on_overflow=true`, the default): the step is rerun with worst-case buffers
  (`EPDispatcher.worst_case()`), so no pair is ever lost. Deciding to rerun needs the flag on the
  host before the optimizer step: this is one device-to-host read of one scalar per step, the price
  of retry. (Exact mode pays one per MoE layer per micro-batch; buffered without retry pays one per
  `overflow_check_every` steps.) A rerun that does not happen costs nothing but that read; a rerun
  costs the step's forward and backward again, at the worst-case buffer size.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..layers.moe import MoEStats
from .health import AllReduce


class EPOverflowError(RuntimeError):
    """Buffered expert parallelism dropped pairs: the steps were skipped, the run stops."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class OverflowGuard:
    def __init__(self, optimizer: torch.optim.Optimizer, reduce: AllReduce, capacity: int,
                 factor: float, check_every: int) -> None:
        if not isinstance(optimizer, torch.optim.AdamW):
            raise ValueError(f"EP overflow skip: optimizer {type(optimizer).__name__} has no eager state init")
        self.optimizer, self.reduce = optimizer, reduce
        self.capacity, self.factor, self.check_every = capacity, factor, check_every
        zero = lambda: torch.zeros((), dtype=torch.int64,  # noqa: E731  (with the parameters)
                                   device=optimizer.param_groups[0]["params"][0].device)
        self.dropped = zero()  # unhandled dropped pairs since the last check
        self.skipped = zero()  # steps skipped since the last check
        self.demand = zero()  # busiest link seen since the last check
        self.retried = 0  # host count of reruns
        self._init_state()

    @torch.no_grad()
    def _init_state(self) -> None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p not in self.optimizer.state:
                    self.optimizer.state[p] = {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}

    @staticmethod
    def count(stats: list[MoEStats]) -> tuple[torch.Tensor, torch.Tensor]:
        """(dropped pairs, busiest link demand) of one micro-batch's MoE layers; device scalars."""
        dev = stats[0].pairs_dropped.device if stats else None
        dropped = torch.zeros((), dtype=torch.int64, device=dev)
        demand = torch.zeros((), dtype=torch.int64, device=dev)
        for s in stats:
            dropped = dropped + s.pairs_dropped
            if s.link_demand is not None:
                demand = torch.maximum(demand, s.link_demand)
        return dropped, demand

    def reduce_step(self, dropped: torch.Tensor, demand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks' totals for the step (one small all-reduce each); returns (dropped, demand)."""
        dropped, demand = dropped.clone(), demand.clone()
        self.reduce(dropped, "sum")
        self.reduce(demand, "max")
        return dropped, demand

    def note(self, dropped: torch.Tensor, demand: torch.Tensor) -> torch.Tensor:
        """Record an unhandled step; returns the device flag `invalid` for `guarded_step`."""
        invalid = dropped > 0
        self.dropped += dropped
        self.skipped += invalid.long()
        self.demand = torch.maximum(self.demand, demand)
        return invalid

    @torch.no_grad()
    def guarded_step(self, invalid: torch.Tensor) -> None:
        """optimizer.step(), undone on the device where `invalid` (module note)."""
        tensors = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                tensors.append(_local(p))
                tensors += [_local(v) for v in self.optimizer.state[p].values() if torch.is_tensor(v)]
        saved = [t.clone() for t in tensors]
        self.optimizer.step()
        for t, old in zip(tensors, saved):
            t.copy_(torch.where(invalid, old, t))

    def check(self, step: int) -> None:
        """Host read (one sync): raise if any step since the last check dropped pairs."""
        dropped, skipped, demand = torch.stack([self.dropped, self.skipped, self.demand]).tolist()
        if dropped:
            raise EPOverflowError(
                f"expert-parallel buffers overflowed: {dropped} (token, expert) pairs did not fit in "
                f"{skipped} step(s) up to step {step} (those updates were skipped, not applied); "
                f"busiest link demand {demand} pairs > capacity {self.capacity} pairs per link "
                f"(parallel.ragged_buffer_factor={self.factor}). Raise the factor (-1 = worst case), "
                f"set parallel.retry_on_overflow=true, or use parallel.ep_mode=exact")
        self.demand.zero_()
