"""Buffered EP with `on_overflow = "spill"`: the pairs that did not fit travel in a second exchange.

Legend: T tokens on this rank, K slots per token, D model width, L local experts;
    R rows of an expert-major GEMM buffer (`_a`: the buffered batch, `_b`: the spill batch, `_m`: merged)
    C, Cr the first trip's pair and row slots per link; C2, Cr2 the capturable second trip's;
    W the worst case per link, `link_capacity(max_tokens, k, L, P, -1, K)` = max_tokens * min(K, L)

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

The host read of the total happens on every buffered layer call in spill mode, overflow or not
(capturable mode excepted, below): a rank
cannot take part in a collective (or skip one) without knowing on the host whether the others will,
and no rank can know that any other rank overflowed without reading it. So spill costs one read of
one int per layer call (retry: one per step, plus a full rerun on overflow; skip: none). Recompute
repeats the read and gets the same total (same inputs), hence the same collectives as the forward.

Numerics: a token's output is (its buffered pairs' sum) + (its spilled pairs' sum), a different
association than one process's K-term sum, and an expert's group holds its rows in another order;
both are within the fp32 EP noise floor (tests/tolerances.py EP_REDUCED), as exact mode is.

Capturable (`parallel.ep_capturable`, `dispatch_spill_traced`): the host read and the exact-size trip
are what a traced graph cannot hold, so both become device work of fixed shape.
- The second trip is a buffered trip on functional collectives, sent on every call (the decision
  with `valid_TK` = the pairs the first trip turned away; none on a call without overflow). Its links
  hold what the first trip's could not: C2 = W - C pair slots, Cr2 = min(C2, max_tokens) row slots.
  Without de-dup a link that overflows kept exactly C pairs (its kept pairs are the prefix of its
  block), so at most W - C are left. With de-dup and Cr < max_tokens a pair is also turned away when
  its token's row finds no slot, even with a pair slot free, so every pair of a link may be left
  (found by enumerating small shapes, tests/distributed/test_ep_capture_spill.py): there C2 = W.
  The two buffers together hold the worst case: nothing is dropped (the second trip's count of
  dropped pairs is reported as the layer's, and is 0). With C = W nothing can spill: no second trip.
- The decision is `ran = group overflow > 0`, a device bool every rank computes from the same count
  exchange. Each of the second trip's exchanges (counts, rows, pair metadata, and in combine the rows
  back) runs under `torch.cond(ran, exchange, zeros)` (comm_traced.py `all_to_all_traceable(run=)`); the
  index code around them runs either way. When no rank overflowed every rank sends only zeros, so the
  zero-filled buffer is exactly what the exchange would have returned: the result is the same as
  running it. The cond sits on the exchanges, one tensor in and one out, because torch's cond does
  not differentiate a branch that returns floats and integers together (torch 2.13).
- The batches merge as above (static shapes: R_a + R_b rows), the GEMM runs once, combine adds the
  two sums. The second trip's byte counts are multiplied by `ran`: 0 when it did not run.
The price: the second trip's index work, buffers and the merged GEMM buffer exist on every call, and
the C2 buffer is allocated whether or not a pair spills. The decision stays on the device only inside
a CUDA graph with conditional nodes: a cond run outside one (eager, aot_eager, inductor's wrapper)
reads its predicate on the host to pick a branch. The CUDA path has not run (CPU and gloo only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..layers.dispatch import DispatchMeta
from ..layers.experts import ExpertBatch
from ..layers.router import RoutingDecision
from . import ep_exchange
from .ep_exchange import Links, Overflow
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


def _joined(batch_a: ExpertBatch, meta_a: Any, batch_b: ExpertBatch, meta_b: Any, align: int,
            dropped: torch.Tensor) -> tuple[ExpertBatch, SpillMeta]:
    """The two trips' batches merged, and their meta (`dropped`: the pairs neither trip holds)."""
    merged, row_a, row_b = merge_batches(batch_a, valid_rows(meta_a, batch_a.x_RD.shape[0]),
                                         batch_b, valid_rows(meta_b, batch_b.x_RD.shape[0]), align)
    meta = SpillMeta(pairs_dropped=dropped, first_expert=meta_a.first_expert,
                     num_local=meta_a.num_local, link_demand=meta_a.link_demand,
                     pairs_spilled=meta_a.pairs_dropped, main=meta_a, extra=meta_b, row_a=row_a, row_b=row_b,
                     bytes_sent=meta_a.bytes_sent + meta_b.bytes_sent)
    return merged, meta


def dispatch_spill(exact: Any, x_TD: torch.Tensor, decision: RoutingDecision, spill_TK: torch.Tensor,
                   batch_a: ExpertBatch, meta_a: Any) -> tuple[ExpertBatch, SpillMeta]:
    """The overflow path: `spill_TK` (bool [T, K]) marks the pairs that did not fit; they go through
    `exact` (the dispatcher in exact mode) and join the buffered batch."""
    batch_b, meta_b = exact.dispatch(x_TD, replace(decision, valid_TK=spill_TK))
    return _joined(batch_a, meta_a, batch_b, meta_b, exact.align, torch.zeros_like(meta_a.pairs_dropped))


def second_links(links: Links, worst: int, max_tokens: int) -> Links | None:
    """The capturable second trip's links: C2 pair slots and Cr2 = min(C2, max_tokens) row slots per
    link (module note); None when the first trip's links hold the worst case W (nothing can spill)."""
    C = links.pair_slots
    if C >= worst:
        return None
    C2 = worst - C if not links.dedup or links.row_slots >= max_tokens else worst
    return replace(links, pair_slots=C2, row_slots=min(C2, max_tokens), spill=False)


def dispatch_spill_traced(links2: Links, x_TD: torch.Tensor, decision: RoutingDecision, over: Overflow,
                          batch_a: ExpertBatch, meta_a: Any, align: int) -> tuple[ExpertBatch, SpillMeta]:
    """The capturable overflow path: every call sends the pairs that did not fit (`over.pairs_TK`,
    none on a call without overflow) through a buffered trip on `links2` whose exchanges run only
    when some rank overflowed (a device bool: module note), and merges the two batches."""
    ran = over.group_total > 0  # the same on every rank: the count exchange's sum
    batch_b, meta_b, _, _ = ep_exchange.dispatch(x_TD, replace(decision, valid_TK=over.pairs_TK),
                                                 replace(links2, run=ran), None)
    # a trip that did not run moved no bytes (its buffers exist all the same)
    meta_b = replace(meta_b, bytes_sent=meta_b.bytes_sent * ran, bytes_back=meta_b.bytes_back * ran,
                     bytes_sent_without_dedup=meta_b.bytes_sent_without_dedup * ran)
    return _joined(batch_a, meta_a, batch_b, meta_b, align, meta_b.pairs_dropped)


def combine_spill(disp: Any, exact: Any, y_RD: torch.Tensor, meta: SpillMeta) -> torch.Tensor:
    """Each trip's rows back through its own combine; a token's two sums added."""
    out_a = disp.combine(y_RD.index_select(0, meta.row_a), meta.main)
    out_b = exact.combine(y_RD.index_select(0, meta.row_b), meta.extra)
    return out_a + out_b
