"""The router module: fp32 weights, a selection-only expert-bias buffer, token-choice top-k.

Legend: T tokens, D model width, E experts, K experts per token.

The router GEMM runs in fp32 whatever the model dtype and whatever autocast says: near-tied logits
rounded to bf16 flip expert choices (see ops/routing.py). Its cost is T*D*E, small beside the experts'.
The expert bias lives in a buffer (not a parameter): it is moved by a balancing rule outside the
forward pass, never by gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import RouterConfig
from ..ops import routing


@dataclass(frozen=True)
class RoutingDecision:
    ids_TK: torch.Tensor  # int64
    weights_TK: torch.Tensor  # fp32 combine weights
    scores_TE: torch.Tensor  # fp32 scores (unbiased)
    logits_TE: torch.Tensor  # fp32


class Router(nn.Module):
    def __init__(self, d_model: int, num_experts: int, top_k: int, cfg: RouterConfig) -> None:
        super().__init__()
        cfg.validate("router", num_experts, top_k)
        self.cfg = cfg
        self.num_experts = num_experts
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, dtype=torch.float32))
        if cfg.use_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            return torch.nn.functional.linear(x_TD.float(), self.weight.float())

    def forward(self, x_TD: torch.Tensor, replay_ids_TK: torch.Tensor | None = None) -> RoutingDecision:
        """Route `x_TD`. With `replay_ids_TK` the expert choices are taken as given (routing replay,
        forced routing for benchmarks) and only the weights come from this router."""
        logits_TE = self.logits(x_TD)
        c = self.cfg
        if replay_ids_TK is not None:
            if replay_ids_TK.shape != (x_TD.shape[0], self.top_k):
                raise ValueError(f"replay_ids_TK shape {tuple(replay_ids_TK.shape)}: expected "
                                 f"({x_TD.shape[0]}, {self.top_k})")
            weights_TK, scores_TE = routing.weights_at(
                logits_TE, replay_ids_TK, score_func=c.score_func, pre_softmax=c.pre_softmax,
                renormalize=c.renormalize, scaling_factor=c.scaling_factor)
            return RoutingDecision(replay_ids_TK, weights_TK, scores_TE, logits_TE)
        ids_TK, weights_TK, scores_TE = routing.topk_route(
            logits_TE, top_k=self.top_k, score_func=c.score_func, pre_softmax=c.pre_softmax,
            renormalize=c.renormalize, scaling_factor=c.scaling_factor, n_groups=c.n_groups,
            topk_groups=c.topk_groups, bias_E=self.expert_bias,
        )
        return RoutingDecision(ids_TK, weights_TK, scores_TE, logits_TE)
