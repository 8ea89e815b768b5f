"""The MoE layer: router -> dispatch -> grouped experts -> combine (+ shared experts).

Legend: T tokens (all leading dims flattened), D model width, E experts, K experts per token.

The layer returns its losses and statistics instead of adding or storing them: the model sums the
losses with their coefficients, the trainer accumulates the statistics and reads them on the host
once per log interval. Nothing here calls `.item()` or reads a count on the host, so the dropless
path never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import MoEConfig
from ..ops import routing
from .dispatch import Dispatcher, LocalDispatcher
from .experts import GroupedExperts, resolve_backend
from .mlp import MLP
from .router import Router


@dataclass(frozen=True)
class MoEStats:
    """Device tensors, one set per layer call."""

    tokens_per_expert_E: torch.Tensor  # int64: pairs routed to each expert (before any drop)
    pairs_computed: torch.Tensor  # int64 scalar
    pairs_dropped: torch.Tensor  # int64 scalar (0 on every dropless path)


@dataclass(frozen=True)
class MoEOutput:
    y: torch.Tensor  # same shape as the input
    aux_loss: torch.Tensor  # Switch aux loss, without its coefficient
    z_loss: torch.Tensor  # router z-loss, without its coefficient
    stats: MoEStats


class MoELayer(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, dispatcher: Dispatcher | None = None) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.router = Router(d_model, cfg.num_experts, cfg.top_k, cfg.router)
        backend = resolve_backend(cfg.backend, cfg.capacity_factor is not None)
        self.experts = GroupedExperts(cfg.num_experts, d_model, cfg.d_expert, cfg.activation,
                                      cfg.act_clamp, cfg.act_softcap, backend)
        self.shared = (MLP(d_model, cfg.shared_width, cfg.activation, cfg.act_clamp, cfg.act_softcap)
                       if cfg.shared_width else None)
        self.dispatcher: Dispatcher = dispatcher or LocalDispatcher(
            cfg.num_experts, cfg.align, cfg.capacity_factor, cfg.drop_policy, fold_weights=True)

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None = None) -> MoEOutput:
        """`replay_ids` ([..., K] expert ids, leading dims as x) replaces the router's choice."""
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        replay_TK = replay_ids.reshape(-1, self.cfg.top_k) if replay_ids is not None else None
        decision = self.router(x_TD, replay_TK)
        batch, meta = self.dispatcher.dispatch(x_TD, decision.ids_TK, decision.weights_TK)
        y_RD = self.experts(batch)
        y_TD = self.dispatcher.combine(y_RD, meta)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        counts_E = routing.expert_counts(decision.ids_TK, self.cfg.num_experts)
        probs_TE = routing.router_probs(decision.scores_TE, self.cfg.router.score_func)
        dropped = meta.pairs_dropped
        stats = MoEStats(counts_E, counts_E.sum() - dropped, dropped)
        return MoEOutput(
            y=y_TD.view(shape),
            aux_loss=routing.switch_aux_loss(probs_TE, counts_E, self.cfg.top_k),
            z_loss=routing.z_loss(decision.logits_TE),
            stats=stats,
        )
