"""One expert-parallel layer call's collectives in order: the token rows out (`dispatch`) and the
expert outputs back (`combine`), the dispatcher contract of layers/dispatch.py across ranks.

Legend: P ranks in the EP group, E experts, L = E/P local experts (rank r owns [r*L, (r+1)*L)),
T tokens on this rank, K slots per token, D model width.
    Q   slots of this rank's pairs in expert order (= rank-major); `_q` tensors are indexed by it
    S   token rows this rank sends (a pair each without de-dup; one per (token, rank) with de-dup)
    N   pair slots received; B received token rows; R rows of the expert-major GEMM buffer
    C   per-link pair capacity (buffered mode); Cr per-link row capacity
The index maths is in ep_plan.py; this file runs the collectives of one layer call in order; the
dispatcher object (its settings, buffer sizes and variants) is ep.py's EPDispatcher, which hands
this file the sizes of the call (`Links`).

The protocol (docs/ep_dispatch.md has the full note):
1. Counts: each rank sends every rank an int64 row [pairs per local expert (L), rows]: one
   fixed-size all-to-all, on the device. Invalid slots of a masked decision (expert choice, expert
   threshold) are no pairs: they are not counted, get no row and send nothing.
2. Exact mode reads all split sizes on the host in one go (the only sync), then moves token rows and
   the per-pair metadata (the routing weight; with de-dup also the row index in the link block) with
   variable-split all-to-alls. Buffered mode never reads them: every (source, destination) link has a
   fixed block of C pair slots (Cr row slots), sized from `max_tokens` (the bound every rank shares,
   `parallel.max_tokens_per_rank`), so ranks holding different token counts still run equal
   collectives; pairs past a block are dropped and counted as overflow.
3. The destination lays the pairs out expert-major (expert, then source, then source token order: the
   order the single-device plan uses on the concatenated global batch), each expert group padded to
   `align` rows (the alignment the experts declared, layers/dispatch.py `dispatch_align`), for one
   grouped GEMM over its L experts. The batch carries each row's routing weight (`weights_R`, 0 on
   padding): the weights travelled with the pairs through a differentiable all-to-all, so the
   router gets its gradient back through the reverse trip.
4. The experts apply the weights (the one place for every dispatcher), so combine is an unweighted
   sum. Without de-dup each pair's row goes back and the source sums a token's K slots in slot order
   (the single-device order). With de-dup the destination sums the GEMM rows of a received row
   (its token's pairs on this rank) before the return trip, and the source sums its returned rows
   per token, in rank order. Each sum is one `embedding_bag` (`BagSum`): no fp32 copy of the GEMM
   output, no zero-filled accumulator, no copy of the GEMM output into received order.

Gathers of rows whose index may point nowhere (padding, overflow, the uninitialised tail of the GEMM
output) read a zero row instead of multiplying by a mask, so a NaN in an unused row never leaks: the
all-to-alls that feed a gather append that row to their output (`zero_row=True`); elsewhere `take`
appends it. Determinism: every gather's backward scatters to distinct rows except the de-dup
replication (one received row feeding several pairs) and the source gather of a token sent to several
ranks; their index_add is sequential on CPU; on CUDA it is atomic (order not fixed) unless
torch.use_deterministic_algorithms is on (the trainer's `train.deterministic`, default true), which
gives index_select's backward a deterministic kernel (PyTorch documents it in that list).

Overlap (`during`: the dispatcher's `dispatch_overlapped`, parallel.overlap_shared): step 3's token
rows and metadata are issued asynchronously (comm.all_to_all_start) and the caller's `during` (the
layer's shared experts) runs before they are waited for; the same collectives on the same data, so
bit-identical (docs/ep_health.md).

Payload (`Links.payload`, parallel.dispatch_dtype): step 3's token rows travel encoded (ops/payload.py:
mxfp8 or fp8 blockwise codes and scales, or bf16), encoded once at the source after the gather and
decoded on arrival into x's dtype; the pair metadata, the counts and the combine's rows do not. The
combine stays in the rows' dtype: its rows are the experts' weighted outputs, summed straight into
each token's output with no later GEMM to quantise them for, so a rounding there is a plain error in
the forward; its trip is unchanged, and the dispatch trip's saving is what the knob buys.

Devices: every tensor is made on x's device (constants with `new_full`); the one host read here is
exact mode's `.tolist()` of the split sizes. In buffered mode with `on_overflow="spill"` the count
exchange also carries the group's overflow, which `dispatch` returns (`Overflow`) for the dispatcher
to read (one int) and, when it is nonzero, to send in a second, exact-mode trip (ep_spill.py); a
capturable dispatcher reads nothing: its second trip is this function again, buffered, with every
exchange run under `torch.cond` on the device bool `Links.run` (ep_spill.py `dispatch_spill_traced`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed import ProcessGroup

from ..layers.dispatch import DispatchMeta
from ..layers.experts import ExpertBatch
from ..layers.router import RoutingDecision
from ..ops import payload as _payload
from ..ops import permute as perm
from . import comm, comm_traced
from .ep_plan import BagSum, bags, dest_layout, excl_cumsum, source_pairs, take

_META_BYTES = 8  # per pair with de-dup: fp32 weight + int32 row index
_WEIGHT_BYTES = 4  # per pair without de-dup: the fp32 weight


@dataclass(frozen=True)
class Links:
    """What one call's exchange is sized by: the dispatcher's settings and, in buffered mode, the
    fixed link blocks (`EPDispatcher.links`)."""

    group: ProcessGroup | None
    ep_size: int  # P
    num_experts: int  # the dispatcher's slots over the group (P*(L+S) with hot-expert replicas)
    num_local: int  # L: this rank's GEMM groups
    first_expert: int
    align: int
    dedup: bool
    pair_slots: int | None  # C, pair slots per link; None: exact mode (sizes read on the host)
    row_slots: int | None  # Cr, token-row slots per link (de-dup); None: exact mode
    spill: bool  # buffered with on_overflow "spill": the count exchange carries each rank's overflow
    payload: str = "native"  # the token rows' encoding on the wire (ops/payload.py, parallel.dispatch_dtype)
    traceable: bool = False  # buffered: functional collectives, traced without a graph break (ep_capturable)
    # traceable: a device bool that runs the exchanges (False: zero-filled buffers; spill's second trip)
    run: torch.Tensor | None = field(default=None, compare=False)


@dataclass(frozen=True, kw_only=True)
class EPMeta(DispatchMeta):
    """What combine needs, plus the statistics (int64 device scalars). pairs_dropped = overflow."""

    num_tokens: int
    # source side: the returned rows summed per token (`BagSum` operands)
    back_seg: torch.Tensor  # token of each returned row; T = none
    back_bags: tuple[torch.Tensor, torch.Tensor]
    # destination side
    row_n: torch.Tensor  # GEMM buffer row of each received pair slot (no de-dup)
    valid_n: torch.Tensor
    src_R: torch.Tensor | None  # de-dup (None: without): received row of each GEMM row; B = none
    presum_bags: tuple[torch.Tensor, torch.Tensor] | None  # de-dup: GEMM rows grouped by received row
    rows_recv: int  # de-dup: B, received token rows
    # the return trip: splits (exact) or None (buffered, fixed)
    splits_back: tuple[tuple[int, ...], tuple[int, ...]] | None
    traceable: bool  # the return trip on functional collectives (Links.traceable)
    run: torch.Tensor | None  # ... run when this device bool is True (Links.run)
    # statistics
    bytes_sent: torch.Tensor
    bytes_sent_without_dedup: torch.Tensor
    bytes_back: torch.Tensor  # the dispatch trip reversed in the backward (gradients of rows and weights)

    @property
    def overflow(self) -> torch.Tensor:
        return self.pairs_dropped


@dataclass(frozen=True)
class Overflow:
    """Spill mode: what did not fit, for the dispatcher's second exchange (ep_spill.py)."""

    group_total: torch.Tensor  # int64 scalar: the pairs past their link blocks, summed over the group
    pairs_TK: torch.Tensor  # bool: this rank's valid pairs that got no slot


def dispatch(x_TD: torch.Tensor, decision: RoutingDecision, links: Links,
             during: Callable[[], torch.Tensor] | None
             ) -> tuple[ExpertBatch, EPMeta, torch.Tensor | None, Overflow | None]:
    """The rows out, steps 1-4 of the module note. `during()` (the shared experts), when given, is
    computed while the token rows and their metadata are in flight: the exchange is issued
    (`comm.all_to_all_start`), `during` runs, then it is waited for; its result comes back third
    (None: the blocking exchange, nothing run). Fourth, in spill mode, what did not fit."""
    def send(t: torch.Tensor, out_s: tuple | None, in_s: tuple | None, zero_row: bool = False,
             payload: str = "native") -> object:
        if links.traceable:  # buffered, native rows (EPDispatcher checks): one traced exchange
            return comm_traced.all_to_all_traceable(t, links.group, zero_row, run=links.run)
        if during is not None:
            return comm.all_to_all_start(t, out_s, in_s, links.group, zero_row, payload)
        if out_s is None:
            return comm.all_to_all_fixed(t, links.group, zero_row=zero_row, payload=payload)
        return comm.all_to_all(t, out_s, in_s, links.group, zero_row=zero_row, payload=payload)

    def overlap(*sent: object) -> tuple:
        extra = during() if during is not None else None
        return (extra, *(comm.all_to_all_wait(p) if isinstance(p, comm.Pending) else p for p in sent))

    Pn, L, dev = links.ep_size, links.num_local, x_TD.device
    ids_TK = decision.ids_TK
    T, K = ids_TK.shape
    D, wire = x_TD.shape[1], links.payload
    rb = _payload.row_bytes(wire, D, x_TD.dtype)  # a token row's bytes on the wire
    C, Cr = links.pair_slots, links.row_slots
    buffered = C is not None
    src = source_pairs(ids_TK, decision.valid_TK, links.num_experts, Pn, C, Cr, links.dedup)
    plan, keep_q, rank_q, token_q, kept_P = src.plan, src.keep_q, src.rank_q, src.token_q, src.kept_P
    Q = keep_q.numel()
    rows_P = src.fits_TP.sum(0) if links.dedup else kept_P
    # each slot's routing weight (0 on invalid slots); a permute: its backward is a gather
    w_q = perm.permute_weights(decision.weights_TK, plan)

    # 1. counts exchange (fixed size, on the device); spill mode adds this rank's overflow, so
    # that every rank learns the group's total from the same collective
    spill = links.spill
    overflow = src.pairs_P.sum() - kept_P.sum()
    info = [src.kept_PL, rows_P[:, None]] + ([overflow.expand(Pn, 1)] if spill else [])
    info = torch.cat(info, 1).reshape(-1)
    recv_PX = (comm_traced.all_to_all_traceable(info, links.group, differentiable=False, run=links.run)
               if links.traceable else comm._exchange(info, None, None, links.group)).view(Pn, L + 1 + spill)
    counts_SL = recv_PX[:, :L]  # pairs from source s for local expert l

    # 2. sizes: host read (exact) or static (buffered)
    if buffered:
        n_slots, n_rows_recv = Pn * C, Pn * (Cr if links.dedup else C)
        splits_back = None
    else:
        host = torch.cat([kept_P, rows_P, counts_SL.sum(1), recv_PX[:, L]]).tolist()
        send_pairs, send_rows = host[:Pn], host[Pn:2 * Pn]
        recv_pairs, recv_rows = host[2 * Pn:3 * Pn], host[3 * Pn:4 * Pn]
        n_slots, n_rows_recv = sum(recv_pairs), sum(recv_rows)
        # return trip: what was received goes back (rows with de-dup, pairs without)
        splits_back = (tuple(send_rows), tuple(recv_rows))

    # 3. token rows and pair metadata out
    if links.dedup:
        hit_TP = src.hit_TP
        key_PT = torch.where(hit_TP.T, torch.arange(Pn, device=dev)[:, None], Pn).reshape(-1)
        token_of_sorted = torch.sort(key_PT, stable=True).indices % max(T, 1)
        tq = token_q.clamp(max=max(T - 1, 0))
        meta_q2 = torch.stack([w_q.float(),
                               src.rowidx_TP[tq, rank_q].to(torch.int32).view(torch.float32)], 1)
        if buffered:
            slot = torch.arange(Pn * Cr, device=dev)
            r, i = slot // max(Cr, 1), slot % max(Cr, 1)
            sorted_start_P = excl_cumsum(hit_TP.sum(0))
            pos_S = torch.where(i < rows_P[r], sorted_start_P[r] + i, Pn * T)  # Pn * T: empty slot
            token_S = torch.cat([token_of_sorted, token_of_sorted.new_full((1,), T)])[pos_S]
            x_send = take(x_TD, token_S, token_S < T)
            pair_of_slot = torch.full((Pn * C + 1,), Q, dtype=torch.int64, device=dev)
            pair_of_slot[torch.where(keep_q, rank_q * C + src.j_q, Pn * C)] = torch.arange(Q, device=dev)
            pair_of_slot = pair_of_slot[:-1]
            meta_send = take(meta_q2, pair_of_slot, pair_of_slot < Q)
            x_recv = send(x_send, None, None, zero_row=True, payload=wire)
            meta_recv = send(meta_send, None, None)
            rows_sent, meta_bytes = x_TD.new_full((), Pn * Cr, dtype=torch.int64), Pn * C * _META_BYTES
        else:
            token_S = token_of_sorted[:sum(send_rows)]
            x_send = x_TD.index_select(0, token_S)
            x_recv = send(x_send, tuple(recv_rows), tuple(send_rows), zero_row=True, payload=wire)
            meta_recv = send(meta_q2[:sum(send_pairs)], tuple(recv_pairs), tuple(send_pairs))
            rows_sent, meta_bytes = rows_P.sum(), kept_P.sum() * _META_BYTES
        extra, x_recv, meta_recv = overlap(x_recv, meta_recv)
        w_n = meta_recv[:, 0]
        rowidx_n = meta_recv[:, 1].detach().contiguous().view(torch.int32).long()
        back_seg = token_S
        back_bags = bags(token_S, T)
    else:
        x_PD = perm.permute(x_TD, plan)  # rows in slot order: link blocks, kept pairs first
        if buffered:
            slot = torch.arange(Pn * C, device=dev)
            r, i = slot // max(C, 1), slot % max(C, 1)
            # kept pairs are a prefix of each link block without de-dup
            q_n = (excl_cumsum(src.pairs_P)[r] + i).clamp(max=max(Q - 1, 0))
            sent_n = i < kept_P[r]
            x_recv = send(take(x_PD, q_n, sent_n), None, None, zero_row=True, payload=wire)
            w_recv = send(take(w_q[:, None], q_n, sent_n), None, None, zero_row=True)
            rows_sent, meta_bytes = x_TD.new_full((), Pn * C, dtype=torch.int64), Pn * C * _WEIGHT_BYTES
            n_back = Pn * C
            slot_P = (rank_q * C + src.j_q)[plan.row_of_P]
            seg = torch.cat([token_q, token_q.new_full((1,), T)])[torch.where(sent_n, q_n, Q)]
        else:
            n_back = sum(send_pairs)
            x_recv = send(x_PD[:n_back], tuple(recv_pairs), tuple(send_pairs), zero_row=True, payload=wire)
            w_recv = send(w_q[:n_back, None], tuple(recv_pairs), tuple(send_pairs), zero_row=True)
            rows_sent, meta_bytes = kept_P.sum(), kept_P.sum() * _WEIGHT_BYTES
            slot_P = plan.row_of_P  # the pairs went (and come back) in plan row order
            seg = token_q[:n_back]
        extra, x_recv, w_recv = overlap(x_recv, w_recv)
        w_n = w_recv.view(-1)
        # the returned pairs arrive in the order they left (plus the zero row): pair p of the
        # token-major [T, K] reads its slot, or the zero row n_back when it was not sent
        keep_P = keep_q[plan.row_of_P]
        if plan.mask_P is not None:  # an invalid pair's row_of_P is row 0, another pair's
            keep_P = keep_P & plan.mask_P
        row_P = torch.where(keep_P, slot_P, n_back)
        back_seg = torch.cat([seg, seg.new_full((1,), T)])
        back_bags = (row_P, torch.arange(T + 1, device=dev) * K)
    bytes_sent = rows_sent * rb + meta_bytes
    # the backward's reverse trip: the rows' gradients (bf16 under a payload, comm.py) and the metadata's
    grad_rb = D * (x_TD.element_size() if wire == "native" else 2)
    bytes_back = rows_sent * grad_rb + meta_bytes
    if buffered:
        bytes_plain = x_TD.new_full((), Pn * C * (rb + _WEIGHT_BYTES), dtype=torch.int64)
    else:
        bytes_plain = src.pairs_P.sum() * (rb + _WEIGHT_BYTES)

    # 4. destination layout: pair slot n -> GEMM row; each row's input and weight
    lay = dest_layout(counts_SL, n_slots, C, links.align)
    pair_of_R, valid_R = lay.pair_of_R, lay.pair_of_R < n_slots
    if links.dedup:
        row_base_S = (torch.arange(Pn, device=dev) * Cr if buffered
                      else excl_cumsum(recv_PX[:, L]))
        recvrow_n = row_base_S[lay.s_n] + rowidx_n
        src_R = torch.where(valid_R, recvrow_n[pair_of_R.clamp(max=max(n_slots - 1, 0))]
                            if n_slots else pair_of_R, n_rows_recv)
        x_RD = x_recv.index_select(0, src_R)  # B is the zero row the all-to-all appended
        w_R = take(w_n[:, None], pair_of_R, valid_R).view(-1)
        presum_bags = bags(src_R, n_rows_recv)
    else:
        x_RD = x_recv.index_select(0, pair_of_R)  # n_slots: the appended zero row
        w_R = w_n.index_select(0, pair_of_R)
        src_R = presum_bags = None

    demand = src.pairs_P.max() if Q else x_TD.new_zeros((), dtype=torch.int64)
    meta = EPMeta(pairs_dropped=overflow, first_expert=links.first_expert, num_local=L, link_demand=demand,
                  num_tokens=T, back_seg=back_seg, back_bags=back_bags, row_n=lay.row_n, valid_n=lay.valid_n,
                  src_R=src_R, presum_bags=presum_bags, rows_recv=n_rows_recv, splits_back=splits_back,
                  traceable=links.traceable, run=links.run, bytes_sent=bytes_sent,
                  bytes_sent_without_dedup=bytes_plain, bytes_back=bytes_back,
                  pairs_spilled=overflow.new_zeros(()) if spill else None)
    batch = ExpertBatch(x_RD, lay.offsets_L, weights_R=w_R)
    if not spill:
        return batch, meta, extra, None
    keep_TK = keep_q[plan.row_of_P].view(T, K)
    valid_TK = decision.valid_TK if decision.valid_TK is not None else torch.ones_like(keep_TK)
    return batch, meta, extra, Overflow(recv_PX[:, L + 1].sum(), valid_TK & ~keep_TK)


def combine(y_RD: torch.Tensor, meta: EPMeta, group: ProcessGroup | None) -> torch.Tensor:
    """The rows back to their tokens, an unweighted sum (the experts applied the weights)."""
    buffered, dedup = meta.splits_back is None, meta.src_R is not None
    if dedup:
        # Pre-sum: add every GEMM row into its received row (padding rows go to row B, cut off;
        # a NaN in an unused row lands there too).
        y_send = BagSum.apply(y_RD, meta.src_R, meta.presum_bags, meta.rows_recv)
    elif buffered:
        # back to received order, one row per pair slot. An empty slot reads row 0 (possibly an
        # uninitialised GEMM row): its value travels back but the source never reads it, and
        # the zero gradient it gets back adds nothing.
        y_send = y_RD.index_select(0, torch.where(meta.valid_n, meta.row_n, 0))
    else:
        y_send = y_RD.index_select(0, meta.row_n)  # exact mode: every slot holds a pair
    if meta.traceable:
        y_back = comm_traced.all_to_all_traceable(y_send, group, zero_row=not dedup, run=meta.run)
    elif buffered:
        y_back = comm.all_to_all_fixed(y_send, group, zero_row=not dedup)
    else:
        out_splits, in_splits = meta.splits_back
        y_back = comm.all_to_all(y_send, out_splits, in_splits, group, zero_row=not dedup)
    # de-dup: one row per (token, rank) came back, in rank order; without: one per kept pair,
    # summed in slot order. Either way a per-token sum.
    return BagSum.apply(y_back, meta.back_seg, meta.back_bags, meta.num_tokens)
