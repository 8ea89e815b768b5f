"""Two-level dispatch in buffered mode (`parallel.ep_hierarchy = "node"`, `ep_mode = "buffered"`):
fixed blocks at both levels, no host read, overflow counted per level.

Legend (ep_hier.py's): P = Nn x G ranks, L experts per rank, LG = L*G experts per node, E = P*L,
T tokens on this rank (`max_tokens`: the bound every rank shares), K slots, k = top_k pairs per token.
    Cn  rail blocks: token-row slots per (source rank, destination node) link
    S   slots this rank sends over its rail (Nn*Cn), B slots it receives (Nn*Cn)

Rail trip: every rank sends every node (its rail peer there) one block of Cn row slots, rows in
token order, each with its routing row (K int32 ids, K fp32 weights); `comm.all_to_all_fixed`, no
count exchange: an empty slot's ids arrive as -1 (ids travel shifted by one, and `take` fills an
empty slot with zeros), so the receiver needs no count to skip it. A token goes to a node at most
once, so a link carries at most T rows: Cn = T never overflows. The balanced size: with k distinct
experts drawn uniformly from E, a token reaches a given node (LG of the E experts) with probability

    p = 1 - C(E - LG, k) / C(E, k)        (1 when E - LG < k)

so a rail link carries T*p rows on average, and

    Cn = min(T, ceil(ragged_buffer_factor * T * p))      factor -1, or on_overflow "spill": Cn = T

For E = 64, k = 8 over 2 nodes p = 0.998 (almost every token visits every node: Cn = T for any
factor >= 1.003); over 8 nodes of E = 256, p = 0.66. Rows past a block are not sent: their valid
pairs are the rail's overflow, counted at the source.

Node trip: the flat buffered EPDispatcher over the node group, `max_tokens = Nn*Cn` (the rows the
rail delivers, its shape bound). Its link size is not the flat rule applied to those rows: a
delivered row carries k/(Nn*p) pairs for this node on average, not k. Rank (n, g) receives from its
Nn rail peers the pairs of their tokens on node n, T*k/Nn from each, T*k in all, which it spreads
over the G ranks of the node, so a balanced node link carries T*k/G pairs:

    C = min(Nn*Cn*min(K, L), ceil(ragged_buffer_factor * T*k/G))    factor -1: the worst case

(given to the node dispatcher as its `link_pairs`, the hook the adaptive controller uses for the
flat one; the cap is its own). Its overflow is counted as the flat dispatcher counts it, at the
rank that received the rows (the rail peer of the tokens' rank).

Overflow: `pairs_dropped` = the rail's dropped pairs + the node's, both int64 device scalars: a
layer's count is exact summed over the EP group (the trainer's overflow guard sums over it), but a
node-level drop is counted on the receiving rank, so one rank's pairs_computed + pairs_dropped need
not equal its own T*K. `link_demand` is the node level's (pairs per node link), against which
`HierEPDispatcher.capacity` gives the node link's C (the guard's report); the rail's overflow shows
in the count only. `ragged_buffer_factor = "auto"` is refused: the adaptive controller sizes one
link per layer from one demand, and the two levels are sized in different units (rows, pairs).

Spill (`on_overflow = "spill"`): the rail is sized at its worst case (Cn = T; it cannot overflow)
and the node dispatcher spills its own overflow (ep_spill.py: one host read of the node group's
total per call, a second exact-size exchange inside the node when it is nonzero). A rail spill was
not built: the extra rows would need a node trip of their own too, and since the ranks of one node
sit on different rails, every rank of the EP group would have to learn every rail's total before
the node trip (a group-wide read per call). The price: rail blocks of T rows instead of
min(T, factor*T*p), which at factor 2 costs nothing while p >= 1/2 (two nodes at E = 64, k = 8:
p = 0.998; eight nodes at E = 256, k = 8: p = 0.66) and T against 0.82T at sixteen (p = 0.41).

Retry: `worst_case()` gives Cn = T and the node links' worst case (Nn*T*min(K, L) pairs, Nn*T rows
per link): no level can overflow. `exact()` gives the exact two-level dispatcher.

Bytes: a fixed block travels whole whatever it holds. `bytes_inter_node` counts the (Nn-1) blocks
to other nodes: (Nn-1)*Cn rows and routing rows; `bytes_sent` adds the block to this node (a local
copy) and the node trip's fixed blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from . import comm
from .ep_plan import take
from .ep_spill import SpillMeta


def node_hit_fraction(num_experts: int, top_k: int, nodes: int) -> float:
    """p: the chance that k distinct experts drawn uniformly from E include one of a node's E/Nn."""
    E, k = num_experts, min(top_k, num_experts)
    rest = E - E // nodes
    return 1.0 if rest < k else 1 - math.comb(rest, k) / math.comb(E, k)


def rail_rows(num_tokens: int, top_k: int | None, num_experts: int, nodes: int, factor: float) -> int:
    """Cn, the row slots per rail link for `num_tokens` tokens per rank (module note); -1: T."""
    if factor == -1:
        return num_tokens
    return min(num_tokens, math.ceil(factor * num_tokens * node_hit_fraction(num_experts, top_k, nodes)))


def node_link_pairs(num_tokens: int, top_k: int, node_size: int, factor: float) -> int | None:
    """The node links' pair slots before the node dispatcher's worst-case cap; None: the worst case."""
    return None if factor == -1 else math.ceil(factor * num_tokens * top_k / node_size)


def check_sizing(factor: float | str, top_k: int | None) -> None:
    if factor == "auto":
        raise ValueError("ragged_buffer_factor='auto' with two-level dispatch (ep_hierarchy 'node'): the "
                         "adaptive controller sizes one link per layer, the two levels need two sizes; use a "
                         "number or -1")
    if factor != -1 and top_k is None:
        raise ValueError("top_k=None: buffered two-level dispatch sizes its rail blocks when it is built, "
                         "from the pairs per token (the MoE config's top_k)")


def node_bytes(meta: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The node trip's (bytes_sent, bytes_sent_without_dedup, bytes_back): a spilled call's are its
    two exchanges'."""
    if isinstance(meta, SpillMeta):
        parts = [node_bytes(meta.main), node_bytes(meta.extra)]
        return tuple(a + b for a, b in zip(*parts))  # type: ignore[return-value]
    return meta.bytes_sent, meta.bytes_sent_without_dedup, meta.bytes_back  # type: ignore[attr-defined]


@dataclass(frozen=True)
class RailTrip:
    """What the rail trip delivered (its B rows) and what the return trip and the statistics need."""

    x_BD: torch.Tensor
    w_BK: torch.Tensor  # fp32 routing weights of each received row (differentiable)
    ids_BK: torch.Tensor  # int32 global expert ids; -1: an invalid slot or an empty row slot
    token_S: torch.Tensor  # token of each sent row; T: an empty slot (buffered)
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None  # (out, in) row splits; None: fixed blocks
    rows_sent: int  # rows on the wire from this rank (buffered: every slot of every block)
    rows_away: int  # ... of them to other nodes
    dropped: torch.Tensor  # int64: valid pairs of the rows that did not fit a block (0 in exact mode)


def rail_buffered(x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, node_TK: torch.Tensor,
                  nodes: int, rows: int, group: ProcessGroup | None, payload: str) -> RailTrip:
    """The rail trip on fixed blocks of `rows` (Cn) slots per node: row i of node n's block is the
    i-th token (in token order) with a valid pair on n. `ids_TK` holds -1 for invalid slots and
    `node_TK` Nn for them. Device only."""
    T = ids_TK.shape[0]
    Nn, Cn, dev = nodes, rows, x_TD.device
    pairs_TN = (node_TK[:, :, None] == torch.arange(Nn, device=dev)).sum(1)  # valid pairs per node
    hit_TN = pairs_TN > 0
    row_TN = torch.cumsum(hit_TN.long(), 0) - 1
    fits_TN = hit_TN & (row_TN < Cn)
    slot_TN = torch.arange(Nn, device=dev) * Cn + row_TN
    token_S = torch.full((Nn * Cn + 1,), T, dtype=torch.int64, device=dev)  # the last slot collects misses
    token_S[torch.where(fits_TN, slot_TN, Nn * Cn)] = torch.arange(T, device=dev)[:, None].expand(T, Nn)
    token_S = token_S[:-1]
    sent_S = token_S < T
    x_BD = comm.all_to_all_fixed(take(x_TD, token_S, sent_S), group, payload=payload)
    w_BK = comm.all_to_all_fixed(take(w_TK, token_S, sent_S), group)
    # shifted by one so that the zero an empty slot carries arrives as -1 (no expert)
    ids_BK = comm.all_to_all_fixed(take(ids_TK.to(torch.int32) + 1, token_S, sent_S), group) - 1
    dropped = torch.where(fits_TN, 0, pairs_TN).sum()
    return RailTrip(x_BD, w_BK, ids_BK, token_S, None, Nn * Cn, (Nn - 1) * Cn, dropped)
