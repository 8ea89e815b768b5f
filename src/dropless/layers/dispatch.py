"""Dispatchers: move (token, expert) pairs to the experts and their results back.

Legend: T tokens, K experts per token, D model width, R rows in expert order.

A dispatcher is a plain object with `dispatch(x_TD, ids_TK, weights_TK, valid_TK=None) ->
(ExpertBatch, meta)` and `combine(y_RD, meta) -> y_TD`. `valid_TK` (bool) marks real pairs when the
routing strategy gives tokens a variable number of experts (expert choice, expert threshold); None
means every slot is a pair. A dispatcher that cannot honour a mask must refuse it, never ignore it. The metadata is a frozen dataclass that carries everything combine
needs, so one dispatcher object serves every layer and every micro-batch. The experts module sees only
an ExpertBatch and never knows whether the rows came from this process or from other ranks: the
expert-parallel dispatcher (dropless.distributed.ep) implements the same two methods.

Folded weights (`fold_weights=True`, what MoELayer asks for): dispatch also hands the experts each
row's combine weight (`ExpertBatch.weights_R`), the experts multiply it into their activation, and
combine becomes an unweighted sum of each token's rows (`permute.unpermute`). Same result, but the
weighting touches [R, F] activations instead of [R, D] outputs and combine keeps no [T, K, D] tensor
for its backward. Off by default, because it needs experts that honour `weights_R`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..ops import permute as P
from .experts import ExpertBatch


@dataclass(frozen=True)
class LocalMeta:
    plan: P.RoutingPlan
    weights_TK: torch.Tensor
    weights_folded: bool = False  # the experts already multiplied each row by its weight

    @property
    def pairs_dropped(self) -> torch.Tensor:
        return self.plan.pairs_dropped()


class Dispatcher(Protocol):
    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                 valid_TK: torch.Tensor | None = None) -> tuple[ExpertBatch, object]: ...

    def combine(self, y_RD: torch.Tensor, meta: object) -> torch.Tensor: ...

# Every meta object exposes `pairs_dropped` (an int64 device scalar) for the layer's statistics.


class LocalDispatcher:
    """Single-device dispatch: a routing plan, a gather into expert order, a weighted gather back.

    Dropless by default (capacity_factor None): every pair gets a row and no host sync happens.
    With a capacity factor it is the capacity baseline: C rows per expert, the overflow dropped.
    """

    def __init__(self, num_experts: int, align: int = 1, capacity_factor: float | None = None,
                 drop_policy: str = "position", fold_weights: bool = False) -> None:
        self.num_experts = num_experts
        self.fold_weights = fold_weights
        self.align = align
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy

    def plan(self, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
             valid_TK: torch.Tensor | None = None) -> P.RoutingPlan:
        if self.capacity_factor is None:
            return P.make_plan(ids_TK, self.num_experts, self.align, valid_TK)
        if valid_TK is not None:
            raise ValueError("the capacity baseline takes token-choice routing only (valid_TK given)")
        return P.make_capacity_plan(ids_TK, weights_TK, self.num_experts, self.capacity_factor,
                                    self.drop_policy, self.align)

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                 valid_TK: torch.Tensor | None = None) -> tuple[ExpertBatch, LocalMeta]:
        plan = self.plan(ids_TK, weights_TK, valid_TK)
        weights_R = P.permute_weights(weights_TK, plan) if self.fold_weights else None
        batch = ExpertBatch(P.permute(x_TD, plan), plan.offsets_E, plan.capacity, weights_R)
        return batch, LocalMeta(plan, weights_TK, self.fold_weights)

    def combine(self, y_RD: torch.Tensor, meta: LocalMeta) -> torch.Tensor:
        if meta.weights_folded:
            return P.unpermute(y_RD, meta.plan)
        return P.combine(y_RD, meta.weights_TK, meta.plan)
