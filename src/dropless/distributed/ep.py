"""The expert-parallel dispatcher: the dispatcher contract of layers/dispatch.py, across ranks.

Legend: P ranks in the EP group, E experts, L = E/P local experts (rank r owns [r*L, (r+1)*L)),
T tokens on this rank, K slots per token, D model width.
    Q   slots of this rank's pairs in expert order (= rank-major); `_q` tensors are indexed by it
    S   token rows this rank sends (a pair each without de-dup; one per (token, rank) with de-dup)
    N   pair slots received; B received token rows; R rows of the expert-major GEMM buffer
    C   per-link pair capacity (buffered mode); Cr per-link row capacity
The index maths is in ep_plan.py; this file runs the collectives in order.

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

Overlap (`dispatch_overlapped`, parallel.overlap_shared): step 3's token rows and metadata are issued
asynchronously (comm.all_to_all_start) and the caller's `during` (the layer's shared experts) runs
before they are waited for; the same collectives on the same data, so bit-identical (docs/ep_health.md).

Devices: every tensor is made on x's device (constants with `new_full`); the host reads are exact
mode's one `.tolist()` of the split sizes and, in buffered mode with `on_overflow="spill"`, one int
(the group's overflow, from the count exchange) plus, when it is nonzero, the spill trip's exact-mode
read (ep_spill.py). Buffered mode's link size is a host int: a factor of the balanced load, or with
factor "auto" `link_pairs`, which train/ep_buffers.py sets between steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..config import ParallelConfig
from ..layers.dispatch import DispatchMeta, dispatch_align
from ..layers.experts import ExpertBatch
from ..layers.moe import MoELayer
from ..layers.router import RoutingDecision
from ..ops import permute as perm
from . import comm, ep_spill
from .ep_plan import (
    BagSum,
    bags,
    dest_layout,
    excl_cumsum,
    link_capacity,
    local_expert_count,
    source_pairs,
    take,
)

__all__ = ["EPDispatcher", "EPMeta", "build_ep_dispatcher", "link_capacity", "local_expert_count",
           "must_invalidate"]

# ragged_buffer_factor "auto" before the first check has sized the links (the fixed default's factor)
AUTO_START_FACTOR = 2.0
_META_BYTES = 8  # per pair with de-dup: fp32 weight + int32 row index
_WEIGHT_BYTES = 4  # per pair without de-dup: the fp32 weight


def must_invalidate(overflow: torch.Tensor) -> torch.Tensor:
    """True (a device bool) when a step's pairs did not all fit: its update must be skipped or rerun.

    Pass the overflow summed over layers, micro-batches and the EP group, so every rank agrees."""
    return overflow > 0


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
    # statistics
    bytes_sent: torch.Tensor
    bytes_sent_without_dedup: torch.Tensor

    @property
    def overflow(self) -> torch.Tensor:
        return self.pairs_dropped


class EPDispatcher:
    """Expert-parallel dispatch over `group` (its size is the EP size; its rank picks the experts).

    mode "exact": split sizes read on the host once per call, never drops, any T per rank. mode
    "buffered": fixed per-link buffers sized for `max_tokens` tokens per rank (required), no host
    sync; overflow counted in the meta; T > max_tokens is refused from the shape, before any
    collective, on the rank that holds them: the other ranks cannot learn it without a host read, so
    they wait in the count exchange until the process group's timeout (the trainer never gets there:
    its micro-batches are the bound). `top_k`: the pairs per token the buffers are sized for (None: the decision's slots K;
    the variable-count strategies have K = E slots but about top_k pairs per token). `on_overflow`
    "spill": buffered mode sends the pairs that did not fit in a second exact-size exchange
    (ep_spill.py); "skip" and "retry" are the trainer's business (train/overflow.py).
    `ragged_buffer_factor` "auto": the link size is `link_pairs`, set between steps by
    train/ep_buffers.py.
    """

    def __init__(self, num_experts: int, group: ProcessGroup | None, *, align: int = 1,
                 mode: str = "exact", dedup: bool = True, ragged_buffer_factor: float | str = 2.0,
                 max_tokens: int = 0, top_k: int | None = None, on_overflow: str = "retry",
                 overlap_shared: bool = False) -> None:
        if mode not in ("exact", "buffered"):
            raise ValueError(f"mode={mode!r}: must be 'exact' or 'buffered'")
        if not (ragged_buffer_factor == "auto" or ragged_buffer_factor == -1 or ragged_buffer_factor > 0):
            raise ValueError(f"ragged_buffer_factor={ragged_buffer_factor!r}: must be > 0, -1 or 'auto'")
        if on_overflow not in ("skip", "retry", "spill"):
            raise ValueError(f"on_overflow={on_overflow!r}: must be 'skip', 'retry' or 'spill'")
        if mode == "buffered" and max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens}: buffered EP sizes its fixed buffers from a bound on "
                             "the tokens per rank that every rank shares (parallel.max_tokens_per_rank; the "
                             "trainer fills it from train.batch_size * train.seq_len)")
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_experts = num_experts
        self.num_local = local_expert_count(num_experts, self.ep_size)
        self.align, self.mode, self.dedup = align, mode, dedup
        self.ragged_buffer_factor = ragged_buffer_factor
        self.max_tokens, self.top_k = max_tokens, top_k
        self.on_overflow = on_overflow
        # the layer runs its shared experts inside dispatch, while the token rows are in flight
        # (`dispatch_overlapped`; MoELayer asks for it when this is set)
        self.overlap_shared = overlap_shared
        # "auto": pair slots per link, set between steps by train/ep_buffers.py (None: AUTO_START_FACTOR)
        self.link_pairs: int | None = None

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first local expert."""
        return self.rank * self.num_local

    def capacity(self, num_tokens: int, top_k: int, slots: int | None = None) -> int:
        """Pair slots per link for `num_tokens` tokens per rank (buffered mode's C). "auto": the size
        the adaptive controller set (capped at the worst case), else AUTO_START_FACTOR's."""
        factor = self.ragged_buffer_factor
        if factor == "auto":
            if self.link_pairs is not None:
                return min(self.link_pairs, link_capacity(num_tokens, top_k, self.num_local, self.ep_size, -1, slots))
            factor = AUTO_START_FACTOR
        return link_capacity(num_tokens, top_k, self.num_local, self.ep_size, factor, slots)

    def exact(self) -> "EPDispatcher":
        """The same dispatcher in exact mode: any number of tokens per rank, never drops (one host
        read of the split sizes per call). For evaluation, where ranks may hold different batches."""
        other = object.__new__(type(self))  # a subclass (hot-expert replicas) stays one
        other.__dict__.update(self.__dict__, mode="exact")
        return other

    def _plain_exact(self) -> "EPDispatcher":
        """`exact` as this class, not a subclass: spill's second trip sends ids already mapped."""
        other = object.__new__(EPDispatcher)
        other.__dict__.update(self.__dict__, mode="exact")
        return other

    def worst_case(self) -> "EPDispatcher":
        """The same dispatcher with worst-case buffers: the retry of an overflowing step."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__, ragged_buffer_factor=-1, link_pairs=None)
        return other

    def _link_slots(self, T: int, K: int) -> tuple[int, int] | tuple[None, None]:
        """Buffered mode's (C, Cr) from the shared bound; (None, None) in exact mode. A host check of
        a shape: a rank over the bound raises here, before its first collective."""
        if self.mode == "exact":
            return None, None
        if T > self.max_tokens:
            raise ValueError(f"{T} tokens on EP rank {self.rank} exceed max_tokens={self.max_tokens} "
                             "(parallel.max_tokens_per_rank): buffered EP sizes its fixed buffers from that "
                             "bound, which every rank shares. Raise it, or use parallel.ep_mode='exact'")
        C = self.capacity(self.max_tokens, self.top_k or K, K)
        return C, min(C, self.max_tokens)

    # -- dispatch ----------------------------------------------------------------------------------

    def dispatch(self, x_TD: torch.Tensor, decision: RoutingDecision) -> tuple[ExpertBatch, EPMeta]:
        batch, meta, _ = self.dispatch_overlapped(x_TD, decision, None)
        return batch, meta

    def dispatch_overlapped(self, x_TD: torch.Tensor, decision: RoutingDecision,
                            during: Callable[[], torch.Tensor] | None
                            ) -> tuple[ExpertBatch, EPMeta, torch.Tensor | None]:
        """`dispatch`, and `during()` (the shared experts) computed while the token rows and their
        metadata are in flight: the exchange is issued (`comm.all_to_all_start`), `during` runs, then
        it is waited for; returns its result third. None: the blocking exchange, nothing run."""
        def send(t: torch.Tensor, out_s: tuple | None, in_s: tuple | None, zero_row: bool = False) -> object:
            if during is not None:
                return comm.all_to_all_start(t, out_s, in_s, self.group, zero_row)
            if out_s is None:
                return comm.all_to_all_fixed(t, self.group, zero_row=zero_row)
            return comm.all_to_all(t, out_s, in_s, self.group, zero_row=zero_row)

        def overlap(*sent: object) -> tuple:
            extra = during() if during is not None else None
            return (extra, *(comm.all_to_all_wait(p) if isinstance(p, comm.Pending) else p for p in sent))

        Pn, L, dev = self.ep_size, self.num_local, x_TD.device
        ids_TK = decision.ids_TK
        T, K = ids_TK.shape
        D, es = x_TD.shape[1], x_TD.element_size()
        C, Cr = self._link_slots(T, K)
        buffered = C is not None
        src = source_pairs(ids_TK, decision.valid_TK, self.num_experts, Pn, C, Cr, self.dedup)
        plan, keep_q, rank_q, token_q, kept_P = src.plan, src.keep_q, src.rank_q, src.token_q, src.kept_P
        Q = keep_q.numel()
        rows_P = src.fits_TP.sum(0) if self.dedup else kept_P
        # each slot's routing weight (0 on invalid slots); a permute: its backward is a gather
        w_q = perm.permute_weights(decision.weights_TK, plan)

        # 1. counts exchange (fixed size, on the device); spill mode adds this rank's overflow, so
        # that every rank learns the group's total from the same collective
        spill = buffered and self.on_overflow == "spill"
        overflow = src.pairs_P.sum() - kept_P.sum()
        info = [src.kept_PL, rows_P[:, None]] + ([overflow.expand(Pn, 1)] if spill else [])
        recv_PX = comm._exchange(torch.cat(info, 1).reshape(-1), None, None, self.group).view(Pn, L + 1 + spill)
        counts_SL = recv_PX[:, :L]  # pairs from source s for local expert l

        # 2. sizes: host read (exact) or static (buffered)
        if buffered:
            n_slots, n_rows_recv = Pn * C, Pn * (Cr if self.dedup else C)
            splits_back = None
        else:
            host = torch.cat([kept_P, rows_P, counts_SL.sum(1), recv_PX[:, L]]).tolist()
            send_pairs, send_rows = host[:Pn], host[Pn:2 * Pn]
            recv_pairs, recv_rows = host[2 * Pn:3 * Pn], host[3 * Pn:4 * Pn]
            n_slots, n_rows_recv = sum(recv_pairs), sum(recv_rows)
            # return trip: what was received goes back (rows with de-dup, pairs without)
            splits_back = (tuple(send_rows), tuple(recv_rows))

        # 3. token rows and pair metadata out
        if self.dedup:
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
                x_recv = send(x_send, None, None, zero_row=True)
                meta_recv = send(meta_send, None, None)
                bytes_sent = x_TD.new_full((), Pn * (Cr * D * es + C * _META_BYTES), dtype=torch.int64)
            else:
                token_S = token_of_sorted[:sum(send_rows)]
                x_send = x_TD.index_select(0, token_S)
                x_recv = send(x_send, tuple(recv_rows), tuple(send_rows), zero_row=True)
                meta_recv = send(meta_q2[:sum(send_pairs)], tuple(recv_pairs), tuple(send_pairs))
                bytes_sent = rows_P.sum() * D * es + kept_P.sum() * _META_BYTES
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
                x_recv = send(take(x_PD, q_n, sent_n), None, None, zero_row=True)
                w_recv = send(take(w_q[:, None], q_n, sent_n), None, None, zero_row=True)
                bytes_sent = x_TD.new_full((), Pn * C * (D * es + _WEIGHT_BYTES), dtype=torch.int64)
                n_back = Pn * C
                slot_P = (rank_q * C + src.j_q)[plan.row_of_P]
                seg = torch.cat([token_q, token_q.new_full((1,), T)])[torch.where(sent_n, q_n, Q)]
            else:
                n_back = sum(send_pairs)
                x_recv = send(x_PD[:n_back], tuple(recv_pairs), tuple(send_pairs), zero_row=True)
                w_recv = send(w_q[:n_back, None], tuple(recv_pairs), tuple(send_pairs), zero_row=True)
                bytes_sent = kept_P.sum() * (D * es + _WEIGHT_BYTES)
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
        if buffered:
            bytes_plain = x_TD.new_full((), Pn * C * (D * es + _WEIGHT_BYTES), dtype=torch.int64)
        else:
            bytes_plain = src.pairs_P.sum() * (D * es + _WEIGHT_BYTES)

        # 4. destination layout: pair slot n -> GEMM row; each row's input and weight
        lay = dest_layout(counts_SL, n_slots, C, self.align)
        pair_of_R, valid_R = lay.pair_of_R, lay.pair_of_R < n_slots
        if self.dedup:
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
        meta = EPMeta(pairs_dropped=overflow, first_expert=self.first_expert,
                      num_local=L, link_demand=demand, num_tokens=T, back_seg=back_seg,
                      back_bags=back_bags, row_n=lay.row_n, valid_n=lay.valid_n, src_R=src_R,
                      presum_bags=presum_bags, rows_recv=n_rows_recv, splits_back=splits_back,
                      bytes_sent=bytes_sent, bytes_sent_without_dedup=bytes_plain,
                      pairs_spilled=overflow.new_zeros(()) if spill else None)
        batch = ExpertBatch(x_RD, lay.offsets_L, weights_R=w_R)
        # spill: the one host read of the mode (every rank reads the same total, so all of them take
        # the same branch and run the same collectives); its second exchange reads its own sizes
        if spill and int(recv_PX[:, L + 1].sum()):
            keep_TK = keep_q[plan.row_of_P].view(T, K)
            valid_TK = decision.valid_TK if decision.valid_TK is not None else torch.ones_like(keep_TK)
            return (*ep_spill.dispatch_spill(self._plain_exact(), x_TD, decision, valid_TK & ~keep_TK, batch, meta),
                    extra)
        return batch, meta, extra

    # -- combine -----------------------------------------------------------------------------------

    def combine(self, y_RD: torch.Tensor, meta: EPMeta) -> torch.Tensor:
        """The rows back to their tokens, an unweighted sum (the experts applied the weights)."""
        if isinstance(meta, ep_spill.SpillMeta):
            return ep_spill.combine_spill(self, self.exact(), y_RD, meta)
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
        if buffered:
            y_back = comm.all_to_all_fixed(y_send, self.group, zero_row=not dedup)
        else:
            out_splits, in_splits = meta.splits_back
            y_back = comm.all_to_all(y_send, out_splits, in_splits, self.group, zero_row=not dedup)
        # de-dup: one row per (token, rank) came back, in rank order; without: one per kept pair,
        # summed in slot order. Either way a per-token sum.
        return BagSum.apply(y_back, meta.back_seg, meta.back_bags, meta.num_tokens)


def build_ep_dispatcher(layer: MoELayer, cfg: ParallelConfig, group: ProcessGroup | None) -> EPDispatcher:
    """The EP twin of layers/dispatch.py `build_dispatcher` for `layer` (built for one device): over
    its routed experts, the same row alignment (moe.align and what the experts need), buffers sized
    from `cfg.max_tokens_per_rank` and `moe.top_k`."""
    moe = layer.cfg
    return EPDispatcher(layer.slots.routed, group, align=dispatch_align(moe, layer.experts), mode=cfg.ep_mode,
                        dedup=cfg.dedup, ragged_buffer_factor=cfg.ragged_buffer_factor,
                        max_tokens=cfg.max_tokens_per_rank, top_k=moe.top_k, on_overflow=cfg.overflow_policy,
                        overlap_shared=cfg.overlap_shared)
