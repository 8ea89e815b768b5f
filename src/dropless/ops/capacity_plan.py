"""The capacity baseline's routing plan: each expert gets C rows, the pairs past C dropped.

Legend as in ops/permute.py: T tokens, K experts per token, P = T*K pairs, E experts, C rows per
expert, R = E*C rows. It is what dropless is measured against (`moe.capacity_factor`,
`bench layer`'s `padded_capacity`), and its plan is the capacity layout `padded_bmm` takes.
"""

from __future__ import annotations

import math

import torch

from .permute import RoutingPlan, _bags, bin_counts


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float, align: int = 1) -> int:
    """C = ceil(capacity_factor * T * K / E), rounded up to the alignment."""
    c = math.ceil(capacity_factor * num_tokens * top_k / num_experts)
    return max(align, math.ceil(c / align) * align)


def make_capacity_plan(
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    num_experts: int,
    capacity_factor: float,
    drop_policy: str = "position",
    align: int = 1,
) -> RoutingPlan:
    """Capacity baseline: each expert gets C rows; pairs past C are dropped, empty rows padded.

    drop_policy "position" keeps an expert's earliest tokens; "score" keeps its highest weights.
    """
    T, K = ids_TK.shape
    P, E = T * K, num_experts
    C = capacity(T, K, E, capacity_factor, align)
    ids_P = ids_TK.reshape(-1)
    counts_E = bin_counts(ids_P, E)
    if drop_policy == "score":
        by_score = torch.sort(weights_TK.detach().reshape(-1), descending=True, stable=True).indices
        order_P = by_score[torch.sort(ids_P[by_score], stable=True).indices]
    elif drop_policy == "position":
        order_P = torch.sort(ids_P, stable=True).indices
    else:
        raise ValueError(f"drop_policy={drop_policy!r}: must be 'position' or 'score'")
    ids_sorted = ids_P[order_P]
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank = torch.arange(P, device=ids_P.device) - start_E[ids_sorted]
    keep_sorted = rank < C
    rows_sorted = torch.where(keep_sorted, ids_sorted * C + rank, 0)
    R = E * C
    row_of_P = torch.empty_like(order_P)
    row_of_P[order_P] = rows_sorted  # dropped pairs point at row 0; combine zeroes their weight
    keep_P = torch.empty_like(keep_sorted)
    keep_P[order_P] = keep_sorted
    pair_of_R = torch.full((R + 1,), P, dtype=torch.int64, device=ids_P.device)
    # Dropped pairs are sent to the extra row R, which is then cut off.
    pair_of_R[torch.where(keep_sorted, rows_sorted, R)] = order_P
    pair_of_R = pair_of_R[:R].clone()
    offsets_E = (torch.arange(1, E + 1, device=ids_P.device) * C).to(torch.int32)
    return RoutingPlan(T, K, E, R, counts_E, offsets_E, row_of_P, pair_of_R, keep_P, C,
                       bags_T=_bags(T, K, ids_P.device))
