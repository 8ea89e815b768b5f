"""Buffered EP with `on_overflow = "spill"`: the pairs that did not fit travel in a second exchange.

Legend: T tokens on this rank, K slots per token, D model width, L local experts;
    R rows of an expert-major GEMM buffer (`_a`: the buffered batch, `_b`: the spill batch, `_m`: merged)

Buffered mode drops the pairs past a link's fixed block (docs/ep_buffers.md). With spill, the count exchange
also carries each rank's overflow, so every rank learns the group's total in the same collective; one
host read of that total decides, on every rank alike, whether a second exchange runs. When it does,
the overflowing pairs (and only they: a decision whose validity mask keeps just them) go through an
exact-mode dispatch, whose split sizes are read on the host (its own count exchange and read: the
price of the overflow path, paid in proportion to the overflow, not the step). The two batches are
merged into one expert-major batch (expert l: its buffered rows, then its spilled rows, then the
padding to `align`), so the grouped GEMM runs once; combine splits the GEMM output back, runs each
trip's combine and adds the two per-token sums. Every pair is computed: the step is dropless without a
rerun.

The host read of the total happens on every buffered layer call in spill mode, overflow or not: a rank
cannot take part in a collective (or skip one) without knowing on the host whether the others will,
and no rank can know that any other rank overflowed without reading it. So spill costs one read of
one int per layer call (retry: one per step, plus a full rerun on overflow; skip: none). Recompute
repeats the read and gets the same total (same inputs), hence the same collectives as the forward.

Numerics: a token's output is (its buffered pairs' sum) + (its spilled pairs' sum), a different
association than one process's K-term sum, and an expert's group holds its rows in another order;
both are within the fp32 EP noise floor (tests/tolerances.py EP_REDUCED), as exact mode is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..layers.dispatch import DispatchMeta
from ..layers.experts import ExpertBatch
from ..layers.router import RoutingDecision
from .ep_plan import excl_cumsum


@dataclass(frozen=True, kw_only=True)
class SpillMeta(DispatchMeta):
    """The two trips' metadata and where each batch's rows sit in the merged GEMM buffer."""

    main: Any  # EPMeta of the buffered trip
    extra: Any  # EPMeta of the exact-size spill trip
    row_a: torch.Tensor  # merged row of each buffered row (0 for padding: read, never used)
    row_b: torch.Tensor  # merged row of each spill row
    bytes_sent: torch.Tensor  # both trips

    @property
    def overflow(self) -> torch.Tensor:
        return self.pairs_dropped


def valid_rows(meta: Any, num_rows: int) -> torch.Tensor:
    """bool [R]: the GEMM rows that hold a pair (the others are padding or an unused tail)."""
    row_n = torch.where(meta.valid_n, meta.row_n, num_rows)
    out = torch.zeros(num_rows + 1, dtype=torch.bool, device=row_n.device)
    out[row_n] = True
    return out[:num_rows]


def _group_pos(offsets_L: torch.Tensor, valid_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(group of each row (L past the last group), its position in the group, valid rows per group).
    A group's valid rows are its first rows (dest_layout pads at the end of each group)."""
    L = offsets_L.numel()
    ends = offsets_L.long()
    r = torch.arange(valid_R.numel(), device=valid_R.device)
    g = torch.searchsorted(ends, r, right=True)
    start = torch.cat([ends.new_zeros(1), ends])[g.clamp(max=L)]
    counts = torch.zeros(L + 1, dtype=torch.int64, device=valid_R.device).index_add_(0, g, valid_R.long())
    return g, r - start, counts


def merge_batches(a: ExpertBatch, valid_a: torch.Tensor, b: ExpertBatch, valid_b: torch.Tensor, align: int
                  ) -> tuple[ExpertBatch, torch.Tensor, torch.Tensor]:
    """One expert-major batch holding both: group l = a's rows of l, b's rows of l, padding to
    `align`. Returns (merged, merged row of each a row, merged row of each b row); rows that hold no
    pair map to row 0 (their outputs are never read by their combine)."""
    L = a.offsets_E.numel()
    Ra, Rb = valid_a.numel(), valid_b.numel()
    g_a, pos_a, cnt_a = _group_pos(a.offsets_E, valid_a)
    g_b, pos_b, cnt_b = _group_pos(b.offsets_E, valid_b)
    total_L = (cnt_a + cnt_b)[:L]
    padded_L = (total_L + align - 1) // align * align
    start_L = torch.cat([excl_cumsum(padded_L), padded_L.new_zeros(1)])  # group L: never valid
    mrow_a = start_L[g_a.clamp(max=L)] + pos_a
    mrow_b = start_L[g_b.clamp(max=L)] + cnt_a[g_b.clamp(max=L)] + pos_b
    Rm = Ra + Rb  # >= every valid row + L*(align-1) padding: the rows past the last group are a tail
    src_m = torch.full((Rm + 1,), Rm, dtype=torch.int64, device=valid_a.device)  # Rm: the zero row
    src_m[torch.where(valid_a, mrow_a, Rm)] = torch.arange(Ra, device=valid_a.device)
    src_m[torch.where(valid_b, mrow_b, Rm)] = torch.arange(Ra, Rm, device=valid_a.device)
    src_m = src_m[:Rm]
    x = torch.cat([a.x_RD, b.x_RD, a.x_RD.new_zeros((1, a.x_RD.shape[1]))]).index_select(0, src_m)
    w = torch.cat([a.weights_R, b.weights_R, a.weights_R.new_zeros(1)]).index_select(0, src_m)
    merged = ExpertBatch(x, torch.cumsum(padded_L, 0).to(torch.int32), weights_R=w)
    return merged, torch.where(valid_a, mrow_a, 0), torch.where(valid_b, mrow_b, 0)


def dispatch_spill(exact: Any, x_TD: torch.Tensor, decision: RoutingDecision, spill_TK: torch.Tensor,
                   batch_a: ExpertBatch, meta_a: Any) -> tuple[ExpertBatch, SpillMeta]:
    """The overflow path: `spill_TK` (bool [T, K]) marks the pairs that did not fit; they go through
    `exact` (the dispatcher in exact mode) and join the buffered batch."""
    batch_b, meta_b = exact.dispatch(x_TD, replace(decision, valid_TK=spill_TK))
    merged, row_a, row_b = merge_batches(batch_a, valid_rows(meta_a, batch_a.x_RD.shape[0]),
                                         batch_b, valid_rows(meta_b, batch_b.x_RD.shape[0]), exact.align)
    meta = SpillMeta(pairs_dropped=torch.zeros_like(meta_a.pairs_dropped), first_expert=meta_a.first_expert,
                     num_local=meta_a.num_local, link_demand=meta_a.link_demand,
                     pairs_spilled=meta_a.pairs_dropped, main=meta_a, extra=meta_b, row_a=row_a, row_b=row_b,
                     bytes_sent=meta_a.bytes_sent + meta_b.bytes_sent)
    return merged, meta


def combine_spill(disp: Any, exact: Any, y_RD: torch.Tensor, meta: SpillMeta) -> torch.Tensor:
    """Each trip's rows back through its own combine; a token's two sums added."""
    out_a = disp.combine(y_RD.index_select(0, meta.row_a), meta.main)
    out_b = exact.combine(y_RD.index_select(0, meta.row_b), meta.extra)
    return out_a + out_b
