"""Identity (zero-compute) experts, `moe.n_identity_experts` (docs/model_knobs.md).

Legend: T tokens, K experts per token, D model width (the latent width under LatentMoE), E real
experts, Z identity experts.

The router chooses among E + Z experts: ids E .. E+Z-1 are identity experts. A pair routed to one
returns the token's input row, times its routing weight like any expert's output, so a token that
picks identity experts costs fewer expert GEMM rows: compute per token varies with the routing
(LongCat-Flash's zero-computation experts). They count in routing, balancing and the monitor like any
expert (the layer counts pairs over all E + Z ids; the bias and aux losses see E + Z scores).

Why the input and not zero: a zero expert only discards its routing weight (the token's output
shrinks, nothing is computed either way); the identity expert keeps the weight's share as a scaled
skip of the layer input, which lets a token "opt out" of the experts without losing that share of its
update. (The input is the row the experts read: the normed block input, or its latent projection.)

How it costs no GEMM: identity pairs leave the real experts' decision as invalid slots (the validity
mask the expert-choice strategies already use, ops/permute.py's masked plan), so the dispatcher never
gives them a row; their contribution is one elementwise `w_T * x_TD` with w_T the sum of the token's
identity weights. A token whose every pair is an identity pair reads no expert row; its expert sum
is replaced by zero with a select (`torch.where`), not a multiply, so an uninitialised padding row it
points at can never leak a NaN into it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..expert_slots import ExpertSlots
from .router import RoutingDecision


@dataclass(frozen=True)
class IdentitySplit:
    experts: RoutingDecision  # the decision the real experts run (identity pairs invalid)
    weight_T: torch.Tensor  # fp32: sum of each token's identity-pair weights
    any_real_T: torch.Tensor  # bool: the token has at least one real-expert pair
    is_identity_TK: torch.Tensor  # bool: valid identity pairs
    ids_TK: torch.Tensor  # the router's ids (identity ids included)
    slots: ExpertSlots

    def combine(self, y_TD: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        """The real experts' sum (zero for tokens with none) plus the identity experts' weighted input."""
        y_TD = torch.where(self.any_real_T.unsqueeze(-1), y_TD, 0.0)
        return y_TD + self.weight_T.to(x_TD.dtype).unsqueeze(-1) * x_TD

    def out_sq(self, routed_E: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        """The monitor's per-expert output sum of squares over all E + Z experts: the routed experts'
        (`routed_E`), then the identity experts'. An identity expert's own (unweighted) output row is
        the token's input row, so its sum is over its tokens' mean_d(x^2)."""
        ms_T = x_TD.detach().float().square().mean(-1)
        ms_TK = ms_T.unsqueeze(-1).expand_as(self.ids_TK)
        slot_TK = torch.where(self.is_identity_TK, self.ids_TK - self.slots.routed, 0)
        ident_Z = ms_T.new_zeros(self.slots.identity).index_add_(
            0, slot_TK.reshape(-1), torch.where(self.is_identity_TK, ms_TK, 0.0).reshape(-1))
        return torch.cat([routed_E, ident_Z])


@dataclass(frozen=True)
class NoIdentity:
    """The split of a layer without identity experts: the real experts run the whole decision."""

    experts: RoutingDecision

    def combine(self, y_TD: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        return y_TD

    def out_sq(self, routed_E: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        return routed_E


Split = IdentitySplit | NoIdentity


def split(decision: RoutingDecision, slots: ExpertSlots) -> Split:
    """The real experts' decision and the identity pairs apart (NoIdentity: no identity experts)."""
    if not slots.identity:
        return NoIdentity(decision)
    ids_TK = decision.ids_TK
    any_id_TK = slots.is_identity(ids_TK)
    if decision.valid_TK is not None:
        is_id_TK = any_id_TK & decision.valid_TK
        real_TK = decision.valid_TK & ~is_id_TK
    else:
        is_id_TK, real_TK = any_id_TK, ~any_id_TK
    # identity ids become expert 0 in the real decision: invalid slots, but in range for any plan or
    # table indexed by expert (the hot-replica tables, ep_replicas.py), invalid slots' ids included
    experts = replace(decision, ids_TK=torch.where(any_id_TK, 0, ids_TK), valid_TK=real_TK,
                      weights_TK=torch.where(real_TK, decision.weights_TK, 0.0))
    weight_T = torch.where(is_id_TK, decision.weights_TK, 0.0).sum(-1)
    return IdentitySplit(experts, weight_T, real_TK.any(-1), is_id_TK, ids_TK, slots)
