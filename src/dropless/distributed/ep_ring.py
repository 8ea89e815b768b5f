"""Ring dispatch (`parallel.ep_dispatch = "ring"`): every rank gathers every rank's tokens, computes
its own experts' share of all of them, and a reduce-scatter sums the shares back to the tokens'
ranks. The dispatcher contract of layers/dispatch.py, like ep_exchange.py's two all-to-alls.

Legend: P ranks in the EP group, L local experts (this rank owns [f, f + L)), T tokens on this rank,
M = the tokens every rank contributes (the largest T, padded), N = P*M gathered tokens, K slots,
Q = N*K gathered pairs, B the bound on local pairs, R = B + L*(align-1) GEMM rows, D model width.

What travels (every rank sends the same sizes, no count exchange):
1. `all_gather` of the token rows (in the payload's encoding, ops/payload.py), of the routing weights
   (fp32, differentiable: the backward reduce-scatters their gradients) and of the expert ids (int32,
   -1 for an invalid slot or a padding token). Each token crosses to every rank once, whatever its
   experts: de-dup is built in, and so is sending it where none of its experts live.
2. Locally, the pairs whose expert is on this rank are laid out expert-major (expert, then gathered
   token order = source rank, then the source's token order: the order of the all-to-all destination
   and of the one-process plan on the global batch), each group padded to `align` rows.
3. The experts' rows are summed per gathered token (`BagSum`, rows of tokens with no local pair are
   zero) and `reduce_scatter` sums the P ranks' shares of block r on rank r. The sum over ranks runs
   in the rows' dtype, in the backend's order: fp32 noise against the all-to-all's rank-order sum.

Sizes: exact mode reads on the host the largest T of the group and then the number of local pairs
(two reads per call; so any T per rank and no drop). Buffered mode reads nothing: M = max_tokens and the
local pairs are bounded by B = P x the all-to-all's link capacity (the same `ragged_buffer_factor`),
pairs past it dropped and counted as overflow, as a buffered all-to-all counts them (skip or retry;
spill is the all-to-all's and is refused with the ring).

Bytes, when it wins: the all-to-all sends each token to the ranks its experts live on (de-dup: once
per rank); the ring sends it to all P ranks and the combine returns P shares. Without de-dup the
all-to-all sends k rows per token, so the ring sends fewer bytes once k > P; against de-dup it sends
as many only when every token reaches every rank (k large against E/P), or when buffered links are
as large as the batch. `ring_sends_fewer` decides `"auto"` from these sizes (docs/ep_wire.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..layers.dispatch import DispatchMeta
from ..layers.experts import ExpertBatch
from ..layers.router import RoutingDecision
from ..ops import payload as _payload
from . import comm
from .ep_plan import BagSum, bags, excl_cumsum, take

_SLOT_BYTES = 8  # per gathered slot: int32 expert id + fp32 weight


@dataclass(frozen=True, kw_only=True)
class RingMeta(DispatchMeta):
    """What the ring's combine needs, plus the byte counts (int64 device scalars)."""

    num_tokens: int  # T
    block: int  # M: rows each rank contributes
    seg_R: torch.Tensor  # gathered token of each GEMM row; N for padding and dropped rows
    row_bags: tuple[torch.Tensor, torch.Tensor]
    bytes_sent: torch.Tensor
    bytes_sent_without_dedup: torch.Tensor  # the same: the ring has no de-dup switch
    bytes_back: torch.Tensor

    @property
    def overflow(self) -> torch.Tensor:
        return self.pairs_dropped


def expected_ranks_hit(num_experts: int, num_local: int, top_k: int) -> float:
    """Ranks a token's k distinct experts land on, on average, under uniform routing:
    P * (1 - C(E - L, k) / C(E, k))."""
    E, L, k = num_experts, num_local, top_k
    P = E // L
    miss = math.comb(E - L, k) / math.comb(E, k) if k <= E - L else 0.0
    return P * (1 - miss)


def ring_sends_fewer(*, ep_size: int, num_experts: int, top_k: int, width: int, dtype: torch.dtype,
                     payload: str, mode: str, dedup: bool, link_pairs: int | None, tokens: int) -> bool:
    """Whether the ring's two trips send fewer bytes per rank than the all-to-all's (rows and their
    metadata, out and back), from the sizes alone: the same answer on every rank. Exact mode's
    all-to-all is taken at uniform routing (its bytes depend on the routing); buffered mode's sends
    its fixed blocks (`link_pairs` pairs per link, for `tokens` tokens per rank)."""
    P, E, K = ep_size, num_experts, top_k
    L = E // P
    rb = _payload.row_bytes(payload, width, dtype)  # a row out
    ob = width * dtype.itemsize  # a row back
    T = tokens
    ring = P * T * (rb + K * _SLOT_BYTES + ob)
    if mode == "buffered":
        C = link_pairs
        rows = P * min(C, T) if dedup else P * C
        a2a = rows * (rb + ob) + P * C * (8 if dedup else 4)
    else:
        rows = T * expected_ranks_hit(E, L, K) if dedup else T * K
        a2a = rows * (rb + ob) + T * K * (8 if dedup else 4)
    return ring < a2a


def dispatch(x_TD: torch.Tensor, decision: RoutingDecision, group: ProcessGroup | None, *, first_expert: int,
             num_local: int, align: int, block: int | None, pair_bound: int | None, payload: str
             ) -> tuple[ExpertBatch, RingMeta]:
    """Steps 1-2 of the module note. `block` (M) and `pair_bound` (B): buffered mode's static sizes;
    None: exact mode, both read on the host."""
    P = dist.get_world_size(group)
    T, K = decision.ids_TK.shape
    D, dev = x_TD.shape[1], x_TD.device
    f, L = first_expert, num_local
    if block is None:  # exact: the largest T of the group (one host read, with the pair count below)
        t_P = comm.all_gather_rows(x_TD.new_full((1,), T, dtype=torch.int64), group)
        M = int(t_P.max())
    else:
        M = block
    pad = M - T
    valid_TK = decision.valid_TK if decision.valid_TK is not None else torch.ones_like(decision.ids_TK, dtype=torch.bool)
    ids_TK = torch.where(valid_TK, decision.ids_TK, -1).to(torch.int32)
    x_MD = torch.cat([x_TD, x_TD.new_zeros((pad, D))]) if pad else x_TD
    w_MK = decision.weights_TK.float()
    if pad:
        w_MK = torch.cat([w_MK, w_MK.new_zeros((pad, K))])
        ids_TK = torch.cat([ids_TK, ids_TK.new_full((pad, K), -1)])
    x_ND = comm.all_gather_rows(x_MD, group, payload)
    w_NK = comm.all_gather_rows(w_MK, group)
    ids_NK = comm.all_gather_rows(ids_TK, group)
    N = P * M
    Q = N * K

    # 2. this rank's pairs, expert-major; a stable sort keeps gathered token order inside a group
    local_Q = ((ids_NK >= f) & (ids_NK < f + L)).reshape(-1)
    key_Q = torch.where(local_Q, ids_NK.reshape(-1).long() - f, L)
    sorted_Q, order_Q = torch.sort(key_Q, stable=True)
    edges_L1 = torch.searchsorted(sorted_Q, torch.arange(L + 1, device=dev))
    B = int(edges_L1[L]) if pair_bound is None else min(pair_bound, Q)  # exact: the second host read
    kept_L = (edges_L1[1:].clamp(max=B) - edges_L1[:-1].clamp(max=B))  # a group past B loses its tail
    overflow = edges_L1[L] - kept_L.sum()
    padded_L = (kept_L + (align - 1)) // align * align
    R = B + L * (align - 1)
    # sorted position i (< B) of expert e goes to row padded_start[e] + (i - edges[e])
    i_B = torch.arange(B, device=dev)
    e_B = sorted_Q[:B].clamp(max=L - 1) if B else sorted_Q[:0]
    kept_B = i_B < edges_L1[L]  # the local pairs sort first
    row_B = excl_cumsum(padded_L)[e_B] + i_B - edges_L1[:-1][e_B]
    pair_R = torch.full((R + 1,), Q, dtype=torch.int64, device=dev)
    pair_R[torch.where(kept_B, row_B, R)] = order_Q[:B]
    pair_R = pair_R[:R]
    valid_R = pair_R < Q
    token_R = pair_R // K
    x_RD = take(x_ND, token_R, valid_R)
    w_R = take(w_NK.reshape(Q, 1), pair_R, valid_R).view(-1)
    seg_R = torch.where(valid_R, token_R, N)

    rb = _payload.row_bytes(payload, D, x_TD.dtype)
    sent = N * (rb + K * _SLOT_BYTES)
    back = N * (D * (x_TD.element_size() if payload == "native" else 2) + K * 4)
    demand = local_Q.view(P, M * K).sum(1).max()
    meta = RingMeta(pairs_dropped=overflow, first_expert=f, num_local=L, link_demand=demand, num_tokens=T,
                    block=M, seg_R=seg_R, row_bags=bags(seg_R, N), bytes_sent=x_TD.new_full((), sent, dtype=torch.int64),
                    bytes_sent_without_dedup=x_TD.new_full((), sent, dtype=torch.int64),
                    bytes_back=x_TD.new_full((), back, dtype=torch.int64))
    return ExpertBatch(x_RD, torch.cumsum(padded_L, 0).to(torch.int32), weights_R=w_R), meta


def combine(y_RD: torch.Tensor, meta: RingMeta, group: ProcessGroup | None) -> torch.Tensor:
    """Step 3: the experts' rows summed per gathered token, then the ranks' shares summed to the
    tokens' ranks; the padding tokens cut off."""
    P = dist.get_world_size(group)
    y_ND = BagSum.apply(y_RD, meta.seg_R, meta.row_bags, P * meta.block)
    return comm.reduce_scatter_rows(y_ND, group)[:meta.num_tokens]
