"""Adaptive buffered-EP link sizes: `parallel.ragged_buffer_factor = "auto"`.

Buffered EP gives every (source, destination) link of a layer a fixed block of C pair slots (docs/ep_buffers.md),
which the user otherwise guesses as a factor of the balanced load. Here C is measured instead, per MoE
layer, without a host read inside a step:

- Observe (every micro-batch, on the device): each layer reports `link_demand`, the most pairs this rank
  routed to one destination (all valid pairs, those that overflowed included); a running max per layer.
- Check (every `parallel.overflow_check_every` steps, at the host read the overflow guard already makes):
  the per-layer peaks are max-reduced over the ranks (one small all-reduce) and read with the guard's
  counters (the same single read). Then, per layer:
      target = ceil(MARGIN * max(peaks of the last WINDOW checks))        MARGIN = 1.25, WINDOW = 4
      grow:   target > C  ->  C = target at once
      shrink: target < C  ->  C = max(target, floor(SHRINK * C))          SHRINK = 0.8 per check
  capped at the worst case (a token has at most min(K, L) experts on one rank). The margin covers the
  step-to-step spread of a stationary routing (measured in `dropless bench ep --scenario shifting-skew`);
  the window and the shrink rate keep a burst of skew from being forgotten at the next quiet check.
- After an overflow the size grows at once: with `on_overflow = "retry"` the trainer already knows on
  the host that the step overflowed (it reruns it), so it resizes right after the rerun (one more read,
  on the overflow path only); with "spill" or "skip" the overflow shows at the next check.

Sizes change only at those points, between steps, on every rank alike (the same all-reduced peaks and
the same arithmetic): every rank runs same-size collectives, and a recompute in the backward (which
repeats the layer's all-to-alls) sees the buffers of its own forward.

Before the first check, C is the fixed default's (`ep.AUTO_START_FACTOR`). The sizes are not
checkpointed: a resumed run starts from that default again and re-adapts at its first check.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..layers.moe import MoEStats

MARGIN = 1.25  # capacity over the observed peak
WINDOW = 4  # checks whose peaks the target covers
SHRINK = 0.8  # at most this factor down per check


class AdaptiveBuffers:
    """Per-layer link sizes of the buffered EP dispatchers (those with factor "auto")."""

    def __init__(self, dispatchers: list[Any], tokens: int, top_k: int,
                 reduce: Callable[[torch.Tensor, str], None], device: torch.device) -> None:
        self.dispatchers, self.tokens, self.top_k, self.reduce = dispatchers, tokens, top_k, reduce
        self.worst = [d.worst_case().capacity(tokens, top_k) for d in dispatchers]
        self.sizes = [d.capacity(tokens, top_k) for d in dispatchers]
        self.history: list[list[int]] = [[] for _ in dispatchers]
        self.peak_L = torch.zeros(len(dispatchers), dtype=torch.int64, device=device)
        self._apply()

    def _apply(self) -> None:
        for d, c in zip(self.dispatchers, self.sizes):
            d.link_pairs = c

    def observe(self, stats: list[MoEStats]) -> None:
        """One micro-batch's layers (device only)."""
        demand = [s.link_demand for s in stats if s.link_demand is not None]
        if demand:
            self.peak_L = torch.maximum(self.peak_L, torch.stack(demand))

    def reduced_peaks(self) -> torch.Tensor:
        """The peaks since the last resize, max over the ranks (a device all-reduce), for the caller's read."""
        peaks = self.peak_L.clone()
        self.reduce(peaks, "max")
        return peaks

    def factors(self) -> list[float]:
        """The sizes as ragged_buffer_factor values: C over the balanced link load T*k/P."""
        balanced = self.tokens * self.top_k / self.dispatchers[0].ep_size
        return [round(c / balanced, 3) for c in self.sizes]

    def resize(self, peaks: list[int]) -> dict[str, Any]:
        """New sizes from the peaks read on the host (every rank the same); returns the report."""
        before = list(self.sizes)
        for i, peak in enumerate(peaks):
            hist = self.history[i]
            hist.append(int(peak))
            del hist[:-WINDOW]
            target = min(self.worst[i], max(1, math.ceil(MARGIN * max(hist))))
            c = self.sizes[i]
            self.sizes[i] = target if target >= c else max(target, math.floor(SHRINK * c))
        self._apply()
        self.peak_L.zero_()
        return {"ep_link_peak": [int(p) for p in peaks], "ep_link_pairs_before": before,
                "ep_link_pairs": list(self.sizes), "ep_buffer_factor": self.factors()}
