"""EP buffered mode, trainer side: a step whose pairs did not all fit is never applied.

Buffered expert parallelism (docs/ep_buffers.md) drops the pairs that overflow a fixed per-link buffer and
counts them on the device. The trainer turns the count into a policy, without a host sync per step
unless it must:

- Counting: per step, the dropped pairs of every layer and micro-batch are summed and all-reduced over
  the data-parallel group (so every rank agrees), with the largest per-link demand (max). Device only.
- Skip (`on_overflow="skip"`; older: `retry_on_overflow=false`): an overflowing step is not applied,
  decided on the device. `note()` returns the flag; the trainer ORs it with the non-finite flag
  (nonfinite.py) and the optimizer skips through `found_inf` (optim.step_unless: torch's fused AdamW
  leaves parameters, moments and its step count bit-identical, with no copy of the state), and the
  router buffer rules take the same flag (TrainHealth.end_step), so the expert bias and thresholds do
  not move either. Zeroing the gradients would not be a skip: AdamW would still decay the weights, move
  both moments and count the step. (This mode used to copy parameters and optimizer state before the
  step and restore them with `where`: one extra copy of the training state per rank.) The state is
  created eagerly (zero moments, step 0, what AdamW's first step creates), so the state after a skipped
  first step equals the state before it.
- Check: every `overflow_check_every` steps (and before each checkpoint and at the end) the host
  reads the counters (one sync) and raises `EPOverflowError` with the observed demand and the
  configured capacity. Between checks the skipped steps cost nothing but their compute.
- Spill (`on_overflow="spill"`): the dispatcher itself sends the pairs that did not fit in a second,
  exact-size exchange inside the layer call (distributed/ep_spill.py); nothing drops, nothing to skip
  or rerun here. The guard counts the spilled pairs (`MoEStats.pairs_spilled`) for the check's report.
- Adaptive sizes (`ragged_buffer_factor="auto"`, ep_buffers.py): the guard feeds the per-layer link
  demand to the controller and resizes at each check, from the same host read.
- Retry (`on_overflow="retry"`, the default; `retry_on_overflow=true` in older configs): the step is
  rerun with worst-case buffers (`EPDispatcher.worst_case()`), so no pair is ever lost. Deciding to
  rerun needs the flag on the host before the optimizer step: this is one device-to-host read of one
  scalar per step, the price of retry. (Exact mode pays one per MoE layer per micro-batch; buffered
  without retry pays one per `overflow_check_every` steps.) A rerun that does not happen costs nothing
  but that read; a rerun costs the step's forward and backward again, at the worst-case buffer size.
"""

from __future__ import annotations

from typing import Any

import torch
from ..layers.moe import MoEStats
from .ep_buffers import AdaptiveBuffers
from .layout import AllReduce
from .muon import Muon
from .optim import can_skip


class EPOverflowError(RuntimeError):
    """Buffered expert parallelism dropped pairs: the steps were skipped, the run stops."""


class OverflowGuard:
    def __init__(self, optimizer: torch.optim.Optimizer, reduce: AllReduce, capacity: int,
                 factor: float | str, check_every: int, policy: str = "retry",
                 adaptive: AdaptiveBuffers | None = None) -> None:
        # Muon creates its whole state in its constructor and honours found_inf (train/muon.py)
        if not (isinstance(optimizer, (torch.optim.AdamW, Muon)) and can_skip(optimizer)):
            raise ValueError(f"EP overflow skip: optimizer {type(optimizer).__name__} has no eager state "
                             "init or cannot skip a step on the device (needs torch's fused AdamW or Muon)")
        self.optimizer, self.reduce = optimizer, reduce
        self.capacity, self.factor, self.check_every = capacity, factor, check_every
        zero = lambda: torch.zeros((), dtype=torch.int64,  # noqa: E731  (with the parameters)
                                   device=optimizer.param_groups[0]["params"][0].device)
        self.dropped = zero()  # unhandled dropped pairs since the last check
        self.skipped = zero()  # steps skipped since the last check
        self.demand = zero()  # busiest link seen since the last check
        self.spilled = zero()  # pairs sent in spill exchanges since the last check (this rank)
        self.retried = 0  # host count of reruns
        self.retried_at_check = 0
        self.policy, self.adaptive = policy, adaptive
        self.grown: list[dict[str, Any]] = []  # resizes right after a retried step, for the next report
        self._init_state()

    @torch.no_grad()
    def _init_state(self) -> None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p not in self.optimizer.state:
                    self.optimizer.state[p] = {  # on the parameter's device, as fused AdamW keeps it
                        "step": torch.zeros((), dtype=torch.float32, device=p.device),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}

    @staticmethod
    def count(stats: list[MoEStats]) -> tuple[torch.Tensor, torch.Tensor]:
        """(dropped pairs, busiest link demand) of one micro-batch's MoE layers; device scalars."""
        dev = stats[0].tokens_per_expert_E.device if stats else None
        dropped = torch.zeros((), dtype=torch.int64, device=dev)
        demand = torch.zeros((), dtype=torch.int64, device=dev)
        for s in stats:
            if s.pairs_dropped is not None:  # None: a path that cannot drop
                dropped = dropped + s.pairs_dropped
            if s.link_demand is not None:
                demand = torch.maximum(demand, s.link_demand)
        return dropped, demand

    def observe(self, stats: list[MoEStats]) -> None:
        """One micro-batch's layers: spilled pairs and the adaptive controller's link demand (device only)."""
        for st in stats:
            if st.pairs_spilled is not None:
                self.spilled += st.pairs_spilled
        if self.adaptive is not None:
            self.adaptive.observe(stats)

    def after_retry(self, step: int) -> None:
        """An overflowing step was just rerun: grow the adaptive sizes at once (one read, on the
        overflow path only; the peaks include the step that overflowed)."""
        if self.adaptive is not None:
            report = self.adaptive.resize(self.adaptive.reduced_peaks().tolist())
            self.grown.append({"step": step, **report})

    def reduce_step(self, dropped: torch.Tensor, demand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks' totals for the step (one small all-reduce each); returns (dropped, demand)."""
        dropped, demand = dropped.clone(), demand.clone()
        self.reduce(dropped, "sum")
        self.reduce(demand, "max")
        return dropped, demand

    def note(self, dropped: torch.Tensor, demand: torch.Tensor) -> torch.Tensor:
        """Record an unhandled step; returns the device flag `invalid`: skip this step."""
        invalid = dropped > 0
        self.dropped += dropped
        self.skipped += invalid.long()
        self.demand = torch.maximum(self.demand, demand)
        return invalid

    def check(self, step: int) -> dict[str, Any]:
        """Host read (one sync): raise if any step since the last check dropped pairs; else resize
        the adaptive buffers and return the report row (factor in use, peak demand, overflows)."""
        spilled = self.spilled.clone()
        self.reduce(spilled, "sum")
        extra = [self.adaptive.reduced_peaks()] if self.adaptive is not None else []
        values = torch.cat([torch.stack([self.dropped, self.skipped, self.demand, spilled])] + extra).tolist()
        dropped, skipped, demand, n_spilled = values[:4]
        if dropped:
            raise EPOverflowError(
                f"expert-parallel buffers overflowed: {dropped} (token, expert) pairs did not fit in "
                f"{skipped} step(s) up to step {step} (those updates were skipped, not applied); "
                f"busiest link demand {demand} pairs > capacity {self.capacity} pairs per link "
                f"(parallel.ragged_buffer_factor={self.factor}). Raise the factor (-1 = worst case), "
                f"set parallel.on_overflow=retry or spill, or use parallel.ep_mode=exact")
        self.demand.zero_()
        self.spilled.zero_()
        row: dict[str, Any] = {"step": step, "ep_overflow_policy": self.policy, "ep_busiest_link": demand,
                               "ep_pairs_spilled": n_spilled,
                               "ep_steps_retried": self.retried - self.retried_at_check}
        self.retried_at_check = self.retried
        if self.adaptive is not None:
            row.update(self.adaptive.resize(values[4:]))
            row["ep_grown_after_overflow"], self.grown = self.grown, []
        else:
            row["ep_link_pairs"] = self.capacity
        return row


def build_guard(model: Any, optimizer: torch.optim.Optimizer, reduce: AllReduce | None, p: Any,
                top_k: int, device: torch.device) -> OverflowGuard | None:
    """The trainer's guard for buffered EP (None for exact mode or a model without MoE layers):
    the capacity of the layers' fixed buffers, and with `ragged_buffer_factor = "auto"` the adaptive
    link sizes (train/ep_buffers.py). `p`: the ParallelConfig with its token bound filled in."""
    layers = model.all_moe_layers()  # an MTP module's MoE block dispatches through EP buffers too
    if p.ep_mode != "buffered" or not layers:
        return None
    capacity = layers[0].dispatcher.capacity(p.max_tokens_per_rank, top_k)
    adaptive = (AdaptiveBuffers([m.dispatcher for m in layers], p.max_tokens_per_rank, top_k, reduce, device)
                if p.ragged_buffer_factor == "auto" else None)
    return OverflowGuard(optimizer, reduce, capacity, p.ragged_buffer_factor, p.overflow_check_every,
                         p.overflow_policy, adaptive)
