"""Index maths of the expert-parallel dispatcher: who sends what where, and the expert-major layout.

Legend: P ranks in the EP group, E experts, L = E/P local experts (rank r owns [r*L, (r+1)*L)),
T tokens on this rank, K slots per token, D model width.
    Q   slots of this rank's pairs in expert order (= rank-major, since experts are contiguous per
        rank); `_q` tensors are indexed by that order. Q = T*K, static: with a validity mask the
        invalid slots come last (expert "E", rank "P") and are never sent
    N   pair slots received; R rows of the expert-major GEMM buffer
    C   per-link pair capacity (buffered mode); Cr per-link row capacity (de-dup)

Everything here is fixed-size device arithmetic (sorts, binary searches, cumulative sums, gathers):
no collectives and no host reads, so ep_exchange.py and ep.py decide alone where the protocol syncs. Combine's
per-target sums (`BagSum`) live here too: they are the layout's adjoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..expert_slots import ExpertSlots
from ..ops import permute as perm


def local_expert_count(num_experts: int, ep_size: int) -> int:
    """Slots per rank of `num_experts` dispatcher slots over `ep_size` ranks (ValueError unless it divides)."""
    return ExpertSlots(num_experts, ep_size=ep_size).local


def link_capacity(num_tokens: int, top_k: int, num_local: int, ep_size: int, factor: float,
                  slots: int | None = None) -> int:
    """Pair slots per (source, destination) link in buffered mode, for `num_tokens` tokens per rank.

    Perfectly balanced routing sends T*k/P pairs over each link (k: pairs per token, on average);
    the buffer holds `factor` times that, capped at the worst case T*min(slots, L) (every pair of
    every token on the destination's experts; a token has at most min(slots, L) distinct experts
    there; slots = k for token choice, up to E for the variable-count strategies). factor -1 = the
    worst case.
    """
    worst = num_tokens * min(top_k if slots is None else slots, num_local)
    if factor == -1:
        return worst
    return min(worst, math.ceil(factor * num_tokens * top_k / ep_size))


def excl_cumsum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


def take(src: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """src[idx] where valid, else zero rows. Invalid entries read an appended zero row: selected, never
    multiplied, so garbage in an unused row cannot leak a NaN (and a copy is cheaper than a masked
    select on CPU). The append also keeps an empty `src` in the graph: a rank that skipped the backward
    of a collective would hang the others."""
    src = torch.cat([src, src.new_zeros((1, *src.shape[1:]))])
    return src.index_select(0, torch.where(valid, idx, src.shape[0] - 1))


def bags(key_N: torch.Tensor, num_bags: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by key for `embedding_bag`: (row order, bag start offsets) over num_bags + 1 bags,
    the last one (key == num_bags) collecting the rows to leave out. A stable sort, so each bag sums
    its rows in row order."""
    sorted_N, order_N = torch.sort(key_N, stable=True)
    # bag starts from the sorted keys: sync-free (CUDA bincount reads min and max back on the host)
    return order_N, torch.searchsorted(sorted_N, torch.arange(num_bags + 1, device=key_N.device))


class BagSum(torch.autograd.Function):
    """out[s] = sum of the rows of y in bag s, in bag order; `seg[n]` is the bag of row n (S: none),
    which the backward gathers from. The bags are `(row indices in bag order, bag start offsets)`
    over at least S bags (`bags()` builds them from seg; fixed-size bags of K work too), and every
    row sits in one bag at most, except a zero row that bags may share (seg S: its gradient is 0).
    One `embedding_bag`: it reads each row once, accumulates in fp32 and rounds once to y's dtype
    (the numerics of a bf16 bmm), and writes only the [S, D] result (no fp32 copy of y, no
    zero-filled accumulator). The backward is a gather, bit-reproducible on every device. A NaN in a
    left-out row (uninitialised GEMM tail) reaches neither the output nor any gradient."""

    @staticmethod
    def forward(ctx, y_ND: torch.Tensor, seg_N: torch.Tensor, bags_: tuple[torch.Tensor, torch.Tensor],
                S: int) -> torch.Tensor:
        order, offsets = bags_
        out = torch.nn.functional.embedding_bag(order, y_ND, offsets, mode="sum")
        ctx.save_for_backward(seg_N)
        return out[:S]

    @staticmethod
    def backward(ctx, grad_SD: torch.Tensor):
        (seg_N,) = ctx.saved_tensors
        g_ND = torch.cat([grad_SD, grad_SD.new_zeros((1, grad_SD.shape[1]))]).index_select(0, seg_N)
        return g_ND, None, None, None


@dataclass(frozen=True)
class SourcePairs:
    """This rank's pairs in expert order, where each goes and whether it fits its link."""

    plan: perm.RoutingPlan  # the single-device plan over this rank's pairs (align 1, masked if needed)
    token_q: torch.Tensor  # token of each slot; T for an invalid slot
    rank_q: torch.Tensor  # destination of each slot, clamped to [0, P) (invalid slots: keep_q False)
    keep_q: torch.Tensor  # bool: a valid pair that fits its link (exact mode: every valid pair)
    j_q: torch.Tensor  # position among the kept pairs of its link block
    pairs_P: torch.Tensor  # valid pairs per destination (the link demand)
    kept_PL: torch.Tensor  # kept pairs per (destination, local expert)
    hit_TP: torch.Tensor  # bool: token t has a valid pair on rank r
    fits_TP: torch.Tensor  # bool: ... and its row fits the link's row slots (de-dup)
    rowidx_TP: torch.Tensor  # row of (t, r) in r's block (de-dup)

    @property
    def kept_P(self) -> torch.Tensor:
        return self.kept_PL.sum(1)


def source_pairs(ids_TK: torch.Tensor, valid_TK: torch.Tensor | None, num_experts: int, ep_size: int,
                 C: int | None, Cr: int | None, dedup: bool) -> SourcePairs:
    """Sort this rank's pairs into link blocks. C, Cr: buffered mode's link capacities (pairs, rows);
    None in exact mode (nothing is dropped). Invalid slots are no pairs: no row, no traffic."""
    T, K = ids_TK.shape
    E, Pn = num_experts, ep_size
    L = E // Pn
    dev = ids_TK.device
    plan = perm.make_plan(ids_TK, E, 1, valid_TK)
    order_q = plan.pair_of_R  # row q holds pair order_q[q]; T*K marks an invalid slot (the tail)
    Q = order_q.numel()
    expert_q = torch.cat([ids_TK.reshape(-1), ids_TK.new_full((1,), E)])[order_q]
    valid_q = expert_q < E
    rank_q = (expert_q // L).clamp(max=Pn - 1)
    token_q = order_q // K
    tq = token_q.clamp(max=max(T - 1, 0))
    pairs_P = plan.counts_E.view(Pn, L).sum(1)
    i_q = torch.arange(Q, device=dev) - excl_cumsum(pairs_P)[rank_q]  # position in its link block
    hits_TP = torch.zeros(T, Pn, dtype=torch.int64, device=dev)
    hits_TP.index_put_((tq, rank_q), valid_q.long(), accumulate=True)
    hit_TP = hits_TP > 0
    rowidx_TP = torch.cumsum(hit_TP.long(), 0) - 1
    keep_q, fits_TP = valid_q, hit_TP
    if C is not None:
        keep_q = keep_q & (i_q < C)
        if dedup:
            fits_TP = hit_TP & (rowidx_TP < Cr)
            keep_q = keep_q & fits_TP[tq, rank_q]
    kept_E = torch.zeros(E + 1, dtype=torch.int64, device=dev).index_add_(0, expert_q, keep_q.long())
    kept_PL = kept_E[:E].view(Pn, L)
    j_q = torch.cumsum(keep_q.long(), 0) - 1 - excl_cumsum(kept_PL.sum(1))[rank_q]  # compacted position
    return SourcePairs(plan, token_q, rank_q, keep_q, j_q, pairs_P, kept_PL, hit_TP, fits_TP, rowidx_TP)


@dataclass(frozen=True)
class DestLayout:
    """Received pair slot n -> (source s, index i in its block) -> row of the expert-major buffer."""

    s_n: torch.Tensor  # source rank of each slot
    valid_n: torch.Tensor  # bool: the slot holds a pair
    row_n: torch.Tensor  # GEMM buffer row of each slot
    pair_of_R: torch.Tensor  # slot held by each GEMM row; N = padding
    offsets_L: torch.Tensor  # int32 group ends of the L local experts


def dest_layout(counts_SL: torch.Tensor, n_slots: int, C: int | None, align: int) -> DestLayout:
    """Lay the received pairs out expert-major: expert l, then source rank, then the source's token
    order (the row order the single-device plan gives expert l on the concatenated global batch),
    each group padded to a multiple of `align` rows; R = N + L*(align-1) rows (static bound).
    `counts_SL[s, l]`: pairs from source s for local expert l. Buffered mode (C given): source s
    owns slots [s*C, (s+1)*C), its pairs first; exact mode: the slots are the pairs, source-major."""
    Pn, L = counts_SL.shape
    dev = counts_SL.device
    recv_pairs_S = counts_SL.sum(1)
    n = torch.arange(n_slots, device=dev)
    if C is not None:
        s_n, i_n = n // max(C, 1), n % max(C, 1)
    else:
        ends = torch.cumsum(recv_pairs_S, 0)
        s_n = torch.searchsorted(ends, n, right=True)
        i_n = n - (ends - recv_pairs_S)[s_n.clamp(max=Pn - 1)]
    s_n = s_n.clamp(max=Pn - 1)
    valid_n = i_n < recv_pairs_S[s_n]
    big = max(n_slots, 1) + 1
    within_end_SL = torch.cumsum(counts_SL, 1)
    seq = (torch.arange(Pn, device=dev)[:, None] * big + within_end_SL).reshape(-1)
    g_n = torch.searchsorted(seq, s_n * big + i_n, right=True)
    l_n = (g_n - s_n * L).clamp(0, L - 1)
    total_L = counts_SL.sum(0)
    padded_L = (total_L + align - 1) // align * align
    gstart_L = excl_cumsum(padded_L)
    row_n = (gstart_L[l_n] + excl_cumsum(counts_SL, 0)[s_n, l_n] + i_n
             - (within_end_SL - counts_SL)[s_n, l_n])
    R = n_slots + L * (align - 1)
    pair_of_R = torch.full((R + 1,), n_slots, dtype=torch.int64, device=dev)
    pair_of_R[torch.where(valid_n, row_n, R)] = n
    return DestLayout(s_n, valid_n, row_n, pair_of_R[:R], torch.cumsum(padded_L, 0).to(torch.int32))
