"""The expert-parallel dispatcher: the same `dispatch` / `combine` as LocalDispatcher, across ranks.

Legend: P ranks in the EP group, E experts, L = E/P local experts (rank r owns [r*L, (r+1)*L)),
T tokens on this rank, K slots per token, D model width.
    Q   (token, expert) pairs this rank routes, in expert order (= rank-major, since experts are
        contiguous per rank); `_q` tensors are indexed by that order
    S   token rows this rank sends (a pair each without de-dup; one per (token, rank) with de-dup)
    N   pair slots received; B received token rows; R rows of the expert-major GEMM buffer
    C   per-link pair capacity (buffered mode); Cr per-link row capacity

The protocol (docs/ep.md has the full note):
1. Counts: each rank sends every rank an int64 row [pairs per local expert (L), rows]: one
   fixed-size all-to-all, on the device.
2. Exact mode reads all split sizes on the host in one go (the only sync), then moves token rows (and,
   with de-dup, the per-pair metadata: row index in the link block, routing weight) with a
   variable-split all-to-all. Buffered mode never reads them: every (source, destination) link has a
   fixed block of C pair slots (Cr row slots), pairs past it are dropped and counted as overflow.
3. The destination lays the pairs out expert-major (expert, then source, then source token order: the
   order the single-device plan uses on the concatenated global batch), each expert group padded to
   `align` rows, for one grouped GEMM over its L experts.
4. Combine is the reverse trip. Without de-dup each pair's row goes back and the source applies the
   weights in token order with ops.permute.combine (the single-device code: bit-exact results). With
   de-dup the destination multiplies each GEMM output row by its pair's weight (which travelled with
   it, through the differentiable all-to-all, so weights_TK gets its gradient) and sums the pairs of
   a received row before the return trip; the source sums its returned rows per token, in rank
   order. Both sums are one `embedding_bag` each over rows grouped by their target (`_BagSum`:
   fp32 products and sums, one rounding): no fp32 copy of the GEMM output, no zero-filled
   accumulator, no copy of the GEMM output into received order.

Gathers of rows whose index may point nowhere (padding, overflow, the uninitialised tail of the GEMM
output) read a zero row instead of multiplying by a mask, so a NaN in an unused row never leaks: the
all-to-alls that feed a gather append that row to their output (`zero_row=True`); elsewhere `_take`
appends it. Determinism: every gather's backward scatters to distinct rows except the de-dup
replication (one received row feeding several pairs) and the source gather of a token sent to several
ranks; their index_add is sequential on CPU; on CUDA it is atomic (order not fixed) unless
torch.use_deterministic_algorithms is on (the trainer's `train.deterministic`, default true), which
gives index_select's backward a deterministic kernel (PyTorch documents it in that list).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..config import ParallelConfig
from ..layers.experts import ExpertBatch
from ..ops import permute as perm
from . import comm

_META_BYTES = 8  # per pair with de-dup: fp32 weight + int32 row index


def local_expert_count(num_experts: int, ep_size: int) -> int:
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}: expert "
                         f"parallelism gives every rank the same number of experts")
    return num_experts // ep_size


def link_capacity(num_tokens: int, top_k: int, num_local: int, ep_size: int, factor: float) -> int:
    """Pair slots per (source, destination) link in buffered mode.

    Perfectly balanced routing sends T*K/P pairs over each link; the buffer holds `factor` times that,
    capped at the worst case T*min(K, L) (every pair of every token on the destination's experts;
    a token has at most min(K, L) distinct experts there). factor -1 = the worst case.
    """
    worst = num_tokens * min(top_k, num_local)
    if factor == -1:
        return worst
    return min(worst, math.ceil(factor * num_tokens * top_k / ep_size))


def must_invalidate(overflow: torch.Tensor) -> torch.Tensor:
    """True (a device bool) when a step's pairs did not all fit: its update must be skipped or rerun.

    Pass the overflow summed over layers, micro-batches and the EP group, so every rank agrees."""
    return overflow > 0


def _take(src: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """src[idx] where valid, else zero rows. Invalid entries read an appended zero row: selected, never
    multiplied, so garbage in an unused row cannot leak a NaN (and a copy is cheaper than a masked
    select on CPU). The append also keeps an empty `src` in the graph: a rank that skipped the backward
    of a collective would hang the others."""
    src = torch.cat([src, src.new_zeros((1, *src.shape[1:]))])
    return src.index_select(0, torch.where(valid, idx, src.shape[0] - 1))


def _bags(key_N: torch.Tensor, num_bags: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by key for `embedding_bag`: (row order, bag start offsets) over num_bags + 1 bags,
    the last one (key == num_bags) collecting the rows to leave out. A stable sort, so each bag sums
    its rows in row order."""
    sorted_N, order_N = torch.sort(key_N, stable=True)
    # bag starts from the sorted keys: sync-free (CUDA bincount reads min and max back on the host)
    return order_N, torch.searchsorted(sorted_N, torch.arange(num_bags + 1, device=key_N.device))


class _BagSum(torch.autograd.Function):
    """out[s] = sum over rows n with seg[n] == s of w[n] * y[n] (w None: plain sum), in row order;
    seg == S leaves a row out. One `embedding_bag` over the rows grouped by `_bags`: it multiplies
    and accumulates in fp32 (possibly fused multiply-adds) and rounds once to y's dtype (the numerics
    of a bf16 bmm), reads each row
    once and writes only the [S, D] result (no fp32 copy of y, no zero-filled accumulator). The
    weights are cast to y's dtype first (embedding_bag wants one dtype; the local path's folded
    weights are cast the same way). Every row belongs to one segment at most, so the backward is a
    gather, bit-reproducible on every device. A NaN in a left-out row (uninitialised GEMM tail)
    reaches neither the output nor any gradient."""

    @staticmethod
    def forward(ctx, y_ND: torch.Tensor, w_N: torch.Tensor | None, seg_N: torch.Tensor,
                bags: tuple[torch.Tensor, torch.Tensor], S: int) -> torch.Tensor:
        order_N, offsets = bags
        w_M = None if w_N is None else w_N.to(y_ND.dtype)[order_N]
        out = torch.nn.functional.embedding_bag(order_N, y_ND, offsets, mode="sum", per_sample_weights=w_M)
        ctx.save_for_backward(y_ND, w_N, seg_N)
        ctx.S = S
        return out[:S]

    @staticmethod
    def backward(ctx, grad_SD: torch.Tensor):
        y_ND, w_N, seg_N = ctx.saved_tensors
        g_ND = torch.cat([grad_SD, grad_SD.new_zeros((1, grad_SD.shape[1]))]).index_select(0, seg_N)
        if w_N is None:
            return g_ND, None, None, None, None
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = g_ND * w_N.to(g_ND.dtype)[:, None]
        if ctx.needs_input_grad[1]:
            # where, not a multiply by a mask: a left-out row's y may be NaN (its g is 0)
            grad_w = torch.where(seg_N < ctx.S, torch.linalg.vecdot(g_ND, y_ND), 0).to(w_N.dtype)
        return grad_y, grad_w, None, None, None


def _excl_cumsum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


@dataclass(frozen=True)
class EPMeta:
    """What combine needs, plus the statistics (int64 device scalars)."""

    # source side
    plan: perm.RoutingPlan  # the single-device plan over this rank's pairs (expert order)
    weights_TK: torch.Tensor
    keep_q: torch.Tensor  # bool [Q]: pair fitted its link (always True in exact mode)
    slot_q: torch.Tensor  # link slot of each pair (no de-dup) in the returned buffer
    token_S: torch.Tensor | None  # de-dup: token of each sent (= returned) row slot; T = empty slot
    back_bags: tuple[torch.Tensor, torch.Tensor] | None  # de-dup: returned rows grouped by token
    valid_TP: torch.Tensor
    # destination side
    row_n: torch.Tensor  # GEMM buffer row of each received pair slot
    valid_n: torch.Tensor
    src_R: torch.Tensor | None  # de-dup: received row of each GEMM row; B = none (padding)
    w_R: torch.Tensor | None  # de-dup: routing weight of each GEMM row (differentiable; 0 on padding)
    presum_bags: tuple[torch.Tensor, torch.Tensor] | None  # de-dup: GEMM rows grouped by received row
    rows_recv: int  # de-dup: B, received token rows
    # the return trip: splits (exact) or None (buffered, fixed)
    splits_back: tuple[tuple[int, ...], tuple[int, ...]] | None
    # statistics
    overflow: torch.Tensor
    bytes_sent: torch.Tensor
    bytes_sent_without_dedup: torch.Tensor
    link_demand: torch.Tensor  # most pairs this rank routes over one link (before any drop)

    @property
    def pairs_dropped(self) -> torch.Tensor:
        return self.overflow


class EPDispatcher:
    """Expert-parallel dispatch over `group` (its size is the EP size; its rank picks the experts).

    mode "exact": split sizes read on the host once per call, never drops. mode "buffered": fixed
    per-link buffers of `link_capacity(...)` pairs, no host sync; overflow counted in the meta.
    """

    def __init__(self, num_experts: int, group: ProcessGroup | None, *, align: int = 1,
                 mode: str = "exact", dedup: bool = True, ragged_buffer_factor: float = 2.0) -> None:
        if mode not in ("exact", "buffered"):
            raise ValueError(f"mode={mode!r}: must be 'exact' or 'buffered'")
        if not (ragged_buffer_factor == -1 or ragged_buffer_factor > 0):
            raise ValueError(f"ragged_buffer_factor={ragged_buffer_factor!r}: must be > 0 or -1")
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_experts = num_experts
        self.num_local = local_expert_count(num_experts, self.ep_size)
        self.align, self.mode, self.dedup = align, mode, dedup
        self.ragged_buffer_factor = ragged_buffer_factor

    @classmethod
    def from_config(cls, cfg: ParallelConfig, num_experts: int, align: int,
                    group: ProcessGroup | None) -> "EPDispatcher":
        return cls(num_experts, group, align=align, mode=cfg.ep_mode, dedup=cfg.dedup,
                   ragged_buffer_factor=cfg.ragged_buffer_factor)

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first local expert."""
        return self.rank * self.num_local

    def capacity(self, num_tokens: int, top_k: int) -> int:
        """Pair slots per link for `num_tokens` tokens per rank, k each (buffered mode's C)."""
        return link_capacity(num_tokens, top_k, self.num_local, self.ep_size, self.ragged_buffer_factor)

    def exact(self) -> "EPDispatcher":
        """The same dispatcher in exact mode: any number of tokens per rank, never drops (one host
        read of the split sizes per call). For evaluation, where ranks may hold different batches."""
        other = object.__new__(EPDispatcher)
        other.__dict__.update(self.__dict__, mode="exact")
        return other

    def worst_case(self) -> "EPDispatcher":
        """The same dispatcher with worst-case buffers: the retry of an overflowing step."""
        other = object.__new__(EPDispatcher)
        other.__dict__.update(self.__dict__, ragged_buffer_factor=-1)
        return other

    # -- dispatch ----------------------------------------------------------------------------------

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor,
                 weights_TK: torch.Tensor) -> tuple[ExpertBatch, EPMeta]:
        Pn, L, dev = self.ep_size, self.num_local, x_TD.device
        T, K = ids_TK.shape
        D, es = x_TD.shape[1], x_TD.element_size()
        buffered = self.mode == "buffered"
        # Source plan: pairs in expert order, which is rank-major.
        plan = perm.make_plan(ids_TK, self.num_experts)
        order_q = plan.pair_of_R  # align 1: row q holds pair order_q[q]
        Q = order_q.numel()
        expert_q = ids_TK.reshape(-1)[order_q]
        rank_q = expert_q // L
        token_q = order_q // K
        pairs_P = plan.counts_E.view(Pn, L).sum(1)
        i_q = torch.arange(Q, device=dev) - _excl_cumsum(pairs_P)[rank_q]  # position in its link block
        hits_TP = torch.zeros(T, Pn, dtype=torch.int64, device=dev)
        hits_TP.index_put_((token_q, rank_q), torch.ones_like(token_q), accumulate=True)
        hit_TP = hits_TP > 0
        rowidx_TP = torch.cumsum(hit_TP.long(), 0) - 1  # row of (t, r) in r's block (de-dup)

        C = link_capacity(T, K, L, Pn, self.ragged_buffer_factor)
        Cr = min(C, T)
        if buffered:
            keep_q = i_q < C
            fits_TP = hit_TP & (rowidx_TP < Cr) if self.dedup else hit_TP
            if self.dedup:
                keep_q = keep_q & fits_TP[token_q, rank_q]
        else:
            keep_q = torch.ones(Q, dtype=torch.bool, device=dev)
            fits_TP = hit_TP
        kept_E = torch.zeros(self.num_experts, dtype=torch.int64, device=dev).index_add_(
            0, expert_q, keep_q.long())
        kept_PL = kept_E.view(Pn, L)
        kept_P = kept_PL.sum(1)
        j_q = torch.cumsum(keep_q.long(), 0) - 1 - _excl_cumsum(kept_P)[rank_q]  # compacted position
        rows_P = fits_TP.sum(0) if self.dedup else kept_P
        overflow = Q - keep_q.sum()

        # 1. counts exchange (fixed size, on the device)
        info_PX = torch.cat([kept_PL, rows_P[:, None]], 1)
        recv_PX = comm._exchange(info_PX.reshape(-1), None, None, self.group).view(Pn, L + 1)
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

        # 3. token rows (and pair metadata) out
        x_PD = perm.permute(x_TD, plan) if not self.dedup else None
        if self.dedup:
            key_PT = torch.where(hit_TP.T, torch.arange(Pn, device=dev)[:, None], Pn).reshape(-1)
            token_of_sorted = torch.sort(key_PT, stable=True).indices % max(T, 1)
            sorted_start_P = _excl_cumsum(hit_TP.sum(0))
            meta_q2 = torch.stack([weights_TK.reshape(-1)[order_q].float(),
                                   rowidx_TP[token_q, rank_q].to(torch.int32).view(torch.float32)], 1)
            if buffered:
                slot = torch.arange(Pn * Cr, device=dev)
                r, i = slot // max(Cr, 1), slot % max(Cr, 1)
                token_S = torch.where(i < rows_P[r], token_of_sorted[
                    (sorted_start_P[r] + i).clamp(max=max(Pn * T - 1, 0))], T)
                x_send = _take(x_TD, token_S, token_S < T)
                pair_of_slot = torch.full((Pn * C + 1,), Q, dtype=torch.int64, device=dev)
                pair_of_slot[torch.where(keep_q, rank_q * C + j_q, Pn * C)] = torch.arange(Q, device=dev)
                pair_of_slot = pair_of_slot[:-1]
                meta_send = _take(meta_q2, pair_of_slot, pair_of_slot < Q)
                x_recv = comm.all_to_all_fixed(x_send, self.group, zero_row=True)
                meta_recv = comm.all_to_all_fixed(meta_send, self.group)
            else:
                token_S = token_of_sorted[:sum(send_rows)]
                x_send = x_TD.index_select(0, token_S)
                x_recv = comm.all_to_all(x_send, recv_rows, send_rows, self.group, zero_row=True)
                meta_recv = comm.all_to_all(meta_q2, recv_pairs, send_pairs, self.group)
            w_n = meta_recv[:, 0]
            rowidx_n = meta_recv[:, 1].detach().contiguous().view(torch.int32).long()
            bytes_sent = (rows_P.sum() * D * es + kept_P.sum() * _META_BYTES) if not buffered else \
                torch.tensor(Pn * (Cr * D * es + C * _META_BYTES), device=dev)
        else:
            w_n, rowidx_n, token_S = None, None, None
            if buffered:
                slot = torch.arange(Pn * C, device=dev)
                r, i = slot // max(C, 1), slot % max(C, 1)
                # kept pairs are a prefix of each link block without de-dup
                x_send = _take(x_PD, (_excl_cumsum(pairs_P)[r] + i).clamp(max=max(Q - 1, 0)), i < kept_P[r])
                x_recv = comm.all_to_all_fixed(x_send, self.group, zero_row=True)
                bytes_sent = torch.tensor(Pn * C * D * es, device=dev)
            else:
                x_recv = comm.all_to_all(x_PD, recv_pairs, send_pairs, self.group, zero_row=True)
                bytes_sent = kept_P.sum() * D * es
        bytes_plain = torch.tensor(Pn * C * D * es, device=dev) if buffered else pairs_P.sum() * D * es

        # 4. destination layout: pair slot n -> (source s, index i in its block) -> GEMM row
        recv_pairs_S = counts_SL.sum(1)
        if buffered:
            n = torch.arange(n_slots, device=dev)
            s_n, i_n = n // max(C, 1), n % max(C, 1)
            row_base_S = torch.arange(Pn, device=dev) * (Cr if self.dedup else C)
        else:
            ends = torch.cumsum(recv_pairs_S, 0)
            n = torch.arange(n_slots, device=dev)
            s_n = torch.searchsorted(ends, n, right=True)
            i_n = n - (ends - recv_pairs_S)[s_n.clamp(max=Pn - 1)]
            row_base_S = _excl_cumsum(recv_PX[:, L]) if self.dedup else None
        s_n = s_n.clamp(max=Pn - 1)
        valid_n = i_n < recv_pairs_S[s_n]
        big = max(n_slots, 1) + 1
        within_end_SL = torch.cumsum(counts_SL, 1)
        seq = (torch.arange(Pn, device=dev)[:, None] * big + within_end_SL).reshape(-1)
        g_n = torch.searchsorted(seq, s_n * big + i_n, right=True)
        l_n = (g_n - s_n * L).clamp(0, L - 1)
        total_L = counts_SL.sum(0)
        padded_L = (total_L + self.align - 1) // self.align * self.align
        gstart_L = _excl_cumsum(padded_L)
        row_n = gstart_L[l_n] + _excl_cumsum(counts_SL, 0)[s_n, l_n] + i_n - (within_end_SL - counts_SL)[s_n, l_n]
        R = n_slots + L * (self.align - 1)
        pair_of_R = torch.full((R + 1,), n_slots, dtype=torch.int64, device=dev)
        pair_of_R[torch.where(valid_n, row_n, R)] = n
        pair_of_R = pair_of_R[:R]
        if self.dedup:
            recvrow_n = row_base_S[s_n] + rowidx_n
            src_R = torch.where(pair_of_R < n_slots, recvrow_n[pair_of_R.clamp(max=max(n_slots - 1, 0))]
                                if n_slots else pair_of_R, n_rows_recv)
            x_RD = x_recv.index_select(0, src_R)  # B is the zero row the all-to-all appended
            w_R = _take(w_n, pair_of_R, pair_of_R < n_slots)
            presum_bags = _bags(src_R, n_rows_recv)
            back_bags = _bags(token_S, T)
        else:
            x_RD = x_recv.index_select(0, pair_of_R)  # n_slots: the appended zero row
            src_R = w_R = presum_bags = back_bags = None
        offsets_L = torch.cumsum(padded_L, 0).to(torch.int32)

        slot_q = rank_q * C + j_q if buffered else torch.arange(Q, device=dev)
        meta = EPMeta(plan, weights_TK, keep_q, slot_q, token_S, back_bags, fits_TP, row_n, valid_n, src_R,
                      w_R, presum_bags, n_rows_recv, splits_back, overflow, bytes_sent, bytes_plain,
                      pairs_P.max() if Q else torch.zeros((), dtype=torch.int64, device=dev))
        return ExpertBatch(x_RD, offsets_L), meta

    # -- combine -----------------------------------------------------------------------------------

    def combine(self, y_RD: torch.Tensor, meta: EPMeta) -> torch.Tensor:
        buffered = self.mode == "buffered"
        if self.dedup:
            # Pre-sum: weight every GEMM row, add it into its received row (padding rows go to row B,
            # cut off; their weight is 0, and a NaN in an unused row lands there too).
            y_send = _BagSum.apply(y_RD, meta.w_R, meta.src_R, meta.presum_bags, meta.rows_recv)
        elif buffered:
            # back to received order, one row per pair slot. An empty slot reads row 0 (possibly an
            # uninitialised GEMM row): its value travels back but the source never reads it
            # (keep_q), and the zero gradient it gets back adds nothing.
            y_send = y_RD.index_select(0, torch.where(meta.valid_n, meta.row_n, 0))
        else:
            y_send = y_RD.index_select(0, meta.row_n)  # exact mode: every slot holds a pair
        if buffered:
            y_back = comm.all_to_all_fixed(y_send, self.group)
        else:
            out_splits, in_splits = meta.splits_back
            y_back = comm.all_to_all(y_send, out_splits, in_splits, self.group)
        if self.dedup:
            # one row per (token, rank) came back, in rank order: sum them per token
            return _BagSum.apply(y_back, None, meta.token_S, meta.back_bags, meta.weights_TK.shape[0])
        plan, weights_TK = meta.plan, meta.weights_TK
        if buffered:
            y_back = _take(y_back, meta.slot_q, meta.keep_q)
            keep_P = torch.empty_like(meta.keep_q)
            keep_P[plan.pair_of_R] = meta.keep_q
            weights_TK = weights_TK * keep_P.view_as(weights_TK)
        return perm.combine(y_back, weights_TK, plan)
