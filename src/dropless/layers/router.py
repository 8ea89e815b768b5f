"""The router module: fp32 weights, a selection-only expert-bias buffer, and the routing strategies.

Legend: T tokens, D model width, E experts, K experts per token (a static bound for the
variable-count strategies), V hash-table rows.

The router GEMM runs in fp32 whatever the model dtype and whatever autocast says: near-tied logits
rounded to bf16 flip expert choices (see ops/routing.py). Its cost is T*D*E, small beside the experts'.
The expert bias and the expert-threshold thresholds live in buffers (not parameters): they are moved
by a rule outside the forward pass (`set_bias`, `update_threshold`, called by the trainer between
steps), never by gradients and never inside forward, so activation recompute routes identically.

Strategies (RouterConfig.strategy):
- token_choice: top-k per token on score (+ bias).
- expert_choice: each expert takes its top-C tokens; K = E slots with `valid_TK`.
- expert_threshold: every expert whose score beats its threshold; K = max_experts_per_token or E
  slots with `valid_TK`. Thresholds are an EMA of `routing.score_quantile` of past batches.
- hash: experts from a fixed table indexed by token id; needs `token_ids`.
- forced_balance: uniform random, balanced to within one pair per expert; ignores the router.
Hash and forced take their weights from the router's scores at the imposed ids (`weights_at`), like
routing replay, so the router still trains and the compute matches the learned-router path.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ..config import RouterConfig
from ..ops import routing
from ..ops.autocast import autocast_available
from . import init


@dataclass(frozen=True)
class RoutingDecision:
    ids_TK: torch.Tensor  # int64
    weights_TK: torch.Tensor  # fp32 combine weights (0 at invalid slots)
    scores_TE: torch.Tensor  # fp32 scores (unbiased)
    logits_TE: torch.Tensor  # fp32
    valid_TK: torch.Tensor | None = None  # bool; None = every slot is a pair


class Router(nn.Module):
    def __init__(self, d_model: int, num_experts: int, top_k: int, cfg: RouterConfig,
                 adaptive_bias_rate: float = 0.0) -> None:
        super().__init__()
        cfg.validate("router", num_experts, top_k)
        self.cfg = cfg
        self.num_experts = num_experts
        self.top_k = top_k
        self.adaptive_bias_rate = adaptive_bias_rate
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, dtype=torch.float32))
        if cfg.use_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        if adaptive_bias_rate > 0:  # the adaptive bias rule's state (layers/balance.py): checkpointed
            self.register_buffer("bias_step_E", torch.full((num_experts,), adaptive_bias_rate))
            self.register_buffer("bias_sign_E", torch.zeros(num_experts, dtype=torch.float32))
        if cfg.strategy == "expert_threshold":
            self.register_buffer("threshold_E", torch.zeros(num_experts, dtype=torch.float32))
            self.register_buffer("threshold_ready", torch.zeros((), dtype=torch.bool))
        if cfg.strategy == "hash":
            self.register_buffer("hash_table_VK",
                                 routing.make_hash_table(cfg.hash_buckets, num_experts, top_k))
        self.reset_parameters()

    def init_rules(self) -> dict[str, init.Rule]:
        return {"weight": init.normal(self.weight.shape[1] ** -0.5)}

    def reset_parameters(self) -> None:
        init.apply_rules(self)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The buffers' initial values (after `to_empty` on a model built on the meta device)."""
        for name in ("expert_bias", "bias_sign_E", "threshold_E", "threshold_ready"):
            b = getattr(self, name, None)
            if b is not None:
                b.zero_()
        if hasattr(self, "bias_step_E"):
            self.bias_step_E.fill_(self.adaptive_bias_rate)
        if hasattr(self, "hash_table_VK"):
            c = self.cfg
            self.hash_table_VK.copy_(routing.make_hash_table(c.hash_buckets, self.num_experts, self.top_k))

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        dev = x_TD.device.type  # "meta" has no autocast to turn off
        off = torch.autocast(dev, enabled=False) if autocast_available(dev) else nullcontext()
        with off:
            # keeps x_TD in its own dtype for the backward, not its fp32 copy (ops/routing.py)
            w_ED = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
            return routing.router_logits(x_TD, w_ED)

    def selection_base(self, decision: RoutingDecision) -> torch.Tensor:
        """The unbiased tensor the bias is added to: logits for post-softmax, else the scores."""
        c = self.cfg
        return decision.logits_TE if c.score_func == "softmax" and not c.pre_softmax else decision.scores_TE

    def _imposed(self, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> RoutingDecision:
        c = self.cfg
        weights_TK, scores_TE = routing.weights_at(
            logits_TE, ids_TK, score_func=c.score_func, pre_softmax=c.pre_softmax,
            renormalize=c.renormalize, scaling_factor=c.scaling_factor)
        return RoutingDecision(ids_TK, weights_TK, scores_TE, logits_TE)

    def forward(self, x_TD: torch.Tensor, replay_ids_TK: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None) -> RoutingDecision:
        """Route `x_TD`. With `replay_ids_TK` the expert choices are taken as given (routing replay)
        and only the weights come from this router. `token_ids` ([T] or any shape with T elements)
        is needed by the hash strategy only."""
        logits_TE = self.logits(x_TD)
        c = self.cfg
        T = x_TD.shape[0]
        if replay_ids_TK is not None:
            if replay_ids_TK.shape != (T, self.top_k):
                raise ValueError(f"replay_ids_TK shape {tuple(replay_ids_TK.shape)}: expected "
                                 f"({T}, {self.top_k})")
            if c.norm_top_k is not None:
                # the denominator would be the mass of this router's own top norm_top_k, which the
                # replayed choice does not say; refuse rather than silently renormalise by top_k
                raise ValueError(f"router.norm_top_k={c.norm_top_k}: routing replay takes the weights "
                                 f"over the replayed top_k={self.top_k} ids only; unset norm_top_k")
            return self._imposed(logits_TE, replay_ids_TK)
        if c.strategy == "hash":
            if token_ids is None or token_ids.numel() != T:
                raise ValueError(f"strategy='hash' needs token_ids with {T} elements, got "
                                 f"{None if token_ids is None else tuple(token_ids.shape)}")
            return self._imposed(logits_TE, routing.hash_ids(token_ids.to(x_TD.device), self.hash_table_VK))
        if c.strategy == "forced_balance":
            ids_TK = routing.forced_balance_ids(T, self.num_experts, self.top_k, x_TD.device)
            return self._imposed(logits_TE, ids_TK)
        if c.strategy == "expert_choice":
            scores_TE = routing.score_fn(logits_TE, c.score_func)
            ids, w, valid = routing.expert_choice_route(
                scores_TE, top_k=self.top_k, capacity_factor=c.expert_capacity_factor,
                scaling_factor=c.scaling_factor)
            return RoutingDecision(ids, w, scores_TE, logits_TE, valid)
        if c.strategy == "expert_threshold":
            scores_TE = routing.score_fn(logits_TE, c.score_func)
            ids, w, valid = routing.threshold_route(
                scores_TE, self.threshold_E, self.threshold_ready, top_k=self.top_k,
                max_slots=c.max_experts_per_token, renormalize=c.renormalize,
                scaling_factor=c.scaling_factor)
            return RoutingDecision(ids, w, scores_TE, logits_TE, valid)
        ids_TK, weights_TK, scores_TE = routing.topk_route(
            logits_TE, top_k=self.top_k, score_func=c.score_func, pre_softmax=c.pre_softmax,
            renormalize=c.renormalize, scaling_factor=c.scaling_factor, n_groups=c.n_groups,
            topk_groups=c.topk_groups, bias_E=self.expert_bias, norm_top_k=c.norm_top_k,
        )
        return RoutingDecision(ids_TK, weights_TK, scores_TE, logits_TE)

    @torch.no_grad()
    def set_adaptive(self, step_E: torch.Tensor, sign_E: torch.Tensor) -> None:
        """Write the adaptive bias rule's per-expert step and last sign."""
        self.bias_step_E.copy_(step_E)
        self.bias_sign_E.copy_(sign_E)

    @torch.no_grad()
    def set_bias(self, bias_E: torch.Tensor) -> None:
        """Write a new expert bias (from balance.bias_update or balance.quantile_bias)."""
        if self.expert_bias is None:
            raise ValueError("router.use_expert_bias is false: there is no bias to set")
        self.expert_bias.copy_(bias_E)

    @torch.no_grad()
    def update_threshold(self, quantile_E: torch.Tensor) -> None:
        """EMA step of the expert-threshold thresholds from a batch's `routing.score_quantile`
        (the layer returns it as `stats.score_quantile_E`); the first batch sets them outright.
        Device ops only: no host sync."""
        m = self.cfg.threshold_momentum
        ema = m * self.threshold_E + (1.0 - m) * quantile_E
        self.threshold_E.copy_(torch.where(self.threshold_ready, ema, quantile_E))
        self.threshold_ready.fill_(True)
