"""The MoE layer: router -> dispatch -> grouped experts -> combine (+ shared experts).

Legend: T tokens (all leading dims flattened), D model width, E experts, K experts per token,
R routed rows in expert order, G groups of the expert batch (E; a rank's slots under EP).

The layer returns its losses and statistics instead of adding or storing them: the model sums the
losses with their coefficients, the trainer accumulates the statistics and reads them on the host
once per log interval. Nothing here calls `.item()` or reads a count on the host, so the dropless
path never waits for the device.

Statistics cost: the default set is the per-expert counts, which the routing plan made anyway (its
sort, binary search and difference), plus the dropped pairs where a path can drop (capacity, EP);
no op of its own on the local dropless path. What derives from the counts (pairs computed, MaxVio,
loads) is computed where it is read: the trainer's accumulators per micro-batch on the device, the
monitor once per log interval. `detailed_stats` (a plain attribute the trainer sets to True on log
steps only, default False) adds the per-expert output sum of squares and two router reductions for
the health monitor: one pass over y_RD and two over scores_TE, all on the device, under no_grad.
The losses: the aux loss is one mean and one dot product (routing.switch_aux_loss), the z-loss a
logsumexp, a square and a mean; both stay per call, as the model adds them to every micro-batch's loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..config import MoEConfig
from ..expert_slots import ExpertSlots
from ..ops import routing
from . import balance, decode_experts, identity, recompute
from .dispatch import DispatchMeta, Dispatcher, LocalMeta, build_dispatcher
from .experts import ExpertBatch, GroupedExperts, resolve_backend
from .latent import LatentProjection
from .mlp import MLP
from .router import Router, RoutingDecision


@dataclass(frozen=True)
class MoEStats:
    """Device tensors, one set per layer call. The Optional ones are None unless asked for."""

    tokens_per_expert_E: torch.Tensor  # int64: pairs routed to each expert (before any drop)
    # int64 scalar: valid pairs that got no row (capacity, EP overflow); None where the path cannot
    # drop (the local dropless plan, the decode path): nothing to compute or to add up
    pairs_dropped: torch.Tensor | None
    # EP buffered mode: most pairs this rank asked one (source, destination) link to carry (int64)
    link_demand: torch.Tensor | None = None
    pairs_spilled: torch.Tensor | None = None  # EP on_overflow "spill": pairs that took the second exchange
    # detailed_stats only:
    out_sq_E: torch.Tensor | None = None  # fp32: sum over e's rows of mean_d(y_row^2)
    router_entropy: torch.Tensor | None = None  # fp32: mean_T of -sum_e p log p (nats)
    top1_top2_ratio: torch.Tensor | None = None  # fp32: mean_T of p_top1 / p_top2
    # balancing rules that need the scores (the trainer applies them between steps):
    score_quantile_E: torch.Tensor | None = None  # strategy expert_threshold: for update_threshold
    quantile_bias_E: torch.Tensor | None = None  # balance.quantile_balance: the proposed bias

    @property
    def pairs_computed(self) -> torch.Tensor:
        """int64 scalar: the pairs that got a row. Derived where it is read (two device ops), not
        by every layer call: the trainer's accumulators never need it."""
        total = self.tokens_per_expert_E.sum()
        return total if self.pairs_dropped is None else total - self.pairs_dropped


@dataclass(frozen=True)
class MoEOutput:
    y: torch.Tensor  # same shape as the input
    aux_loss: torch.Tensor  # micro-batch Switch aux loss, without its coefficient
    z_loss: torch.Tensor  # router z-loss, without its coefficient
    stats: MoEStats
    probs_mean_E: torch.Tensor | None = None  # mean router probability, with grad: global aux loss
    seq_aux_loss: torch.Tensor | None = None  # sequence-scope aux loss (when its coefficient is > 0)
    # the routing decision's expert ids (int64, [T, K], T flattened as in the layer) and, for the
    # variable-count strategies, which slots hold a pair: what routing replay records
    ids_TK: torch.Tensor | None = None
    valid_TK: torch.Tensor | None = None


def expert_out_sq(y_RD: torch.Tensor, offsets_E: torch.Tensor,
                  weights_R: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert sum of the rows' mean squares, from the expert-major output rows.

    Padding rows inside a group are zero rows in, zero rows out (every activation maps 0 to 0 and the
    experts have no bias), so they add nothing; rows past the last group end (uninitialised on the
    grouped_mm path) are never read. The experts multiplied each row by its routing weight
    (`weights_R`, see layers/dispatch.py), so each row is divided by its weight first: the monitor
    wants the expert's own output, not its weighted share (rows of weight 0 count zero).
    """
    y = y_RD.detach().float()
    if weights_R is not None:
        w = weights_R.detach().float().unsqueeze(-1)
        y = torch.where(w != 0, y / torch.where(w != 0, w, 1.0), torch.zeros_like(y))
    ms_R = y.square().mean(-1)
    # Segment sums as differences of one running sum (float64: 10^5 rows of values ~1 lose nothing
    # that matters to a monitor), read at the group ends; rows past the last end are never read,
    # so NaN garbage there cannot reach a sum. (bincount with weights would sync the host on CUDA.)
    run_R1 = torch.cat([ms_R.new_zeros(1, dtype=torch.float64), ms_R.double().cumsum(0)])
    ends_E = offsets_E.long()
    starts_E = torch.cat([ends_E.new_zeros(1), ends_E[:-1]])
    return (run_R1[ends_E] - run_R1[starts_E]).float()


def router_summaries(probs_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean entropy in nats, mean top-1 / top-2 probability ratio); ratio 1 when E = 1."""
    p = probs_TE.detach().float()
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).mean()
    if p.shape[1] < 2:
        return entropy, torch.ones((), device=p.device)
    top2 = p.topk(2, dim=-1).values
    ratio = (top2[:, 0] / top2[:, 1].clamp_min(1e-30)).mean()
    return entropy, ratio


@dataclass(frozen=True)
class RoutedRun:
    """What the routed experts' step of one call leaves for the rest of it."""

    y_TD: torch.Tensor  # the routed experts' weighted sum per token (width of the rows they read)
    meta: DispatchMeta
    # the expert-ordered batch and output rows; None on the decode path (it has neither)
    batch: ExpertBatch | None = None
    y_RD: torch.Tensor | None = None
    shared_TD: torch.Tensor | None = None  # the shared experts, when dispatch ran them (EP overlap)

    def out_sq(self, num_experts: int) -> torch.Tensor:
        """The monitor's output sum of squares per routed expert (`expert_out_sq`, spread over the
        experts by the metadata). Grouped path only: detailed statistics keep a call off the decode path."""
        out_sq_G = expert_out_sq(self.y_RD, self.batch.offsets_E, self.batch.weights_R)
        return self.meta.per_expert(out_sq_G, num_experts)


class MoELayer(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, dispatcher: Dispatcher | None = None) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        # what the slots are (expert_slots.py): what shards or replicates the layer replaces them, and
        # every consumer asks the layer. The router chooses among the routed experts and, after them,
        # the identity experts (identity.py)
        self.slots = ExpertSlots.from_config(cfg)
        b = cfg.balance
        self.router = Router(d_model, self.slots.selectable, cfg.top_k, cfg.router,
                             b.bias_update_rate if b.bias_update_rule == "adaptive" else 0.0)
        backend = resolve_backend(cfg.backend, cfg.capacity_factor is not None)
        # LatentMoE (latent.py): the routed experts run in latent_dim, between two projections
        # (its norm's eps is the default 1e-6: the layer never sees model.norm_eps)
        self.latent = (LatentProjection(d_model, cfg.latent_dim, cfg.latent_norm)
                       if cfg.latent_dim else None)
        d_routed = cfg.latent_dim or d_model
        self.experts = GroupedExperts(self.slots.routed, d_routed, cfg.d_expert, cfg.activation,
                                      cfg.act_clamp, cfg.act_softcap, backend, cfg.precision)
        self.shared = (MLP(d_model, cfg.shared_width, cfg.activation, cfg.act_clamp, cfg.act_softcap)
                       if cfg.shared_width else None)
        # the experts declare the row alignment they need (low-precision token blocks); the factory
        # (and its EP twin, distributed.ep.build_ep_dispatcher) honours it
        self.dispatcher: Dispatcher = dispatcher or build_dispatcher(cfg, self.experts, self.slots)
        self.detailed_stats = False  # set by the trainer on log steps
        # stats.quantile_bias_E: quantile balancing, or the loss-free bias's warm-start steps (the
        # trainer sets it per step, train/health.py)
        self.quantile_stats = cfg.balance.quantile_balance
        self.recompute_shared = False  # model.recompute "shared_experts", set by the model's Block
        # calls of at most this many tokens take the decode path (decode_experts.py; 0 = never,
        # None = the measured default of the device, without autograd only)
        self.decode_max_tokens: int | None = None

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None) -> MoEOutput:
        """`replay_ids` ([..., K] expert ids, leading dims as x) replaces the router's choice;
        `token_ids` (leading dims as x) feeds the hash strategy."""
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        replay_TK = replay_ids.reshape(-1, self.cfg.top_k) if replay_ids is not None else None
        decision = self.router(x_TD, replay_TK, token_ids)
        split = identity.split(decision, self.slots)  # split.experts: what the real experts compute
        xr_TD = self._project_down(x_TD)  # the rows the routed experts read
        routed = self._routed_experts(xr_TD, split.experts, x_TD)  # dispatch, experts, combine
        y_TD = self._project_up(split.combine(routed.y_TD, xr_TD))
        y_TD = self._add_shared(y_TD, routed.shared_TD, x_TD)
        # losses and statistics over the E + Z selectable experts (identity experts count like any)
        counts_E = self._counts(decision, split, routed)
        probs_TE = routing.router_probs(decision.scores_TE, self.cfg.router.score_func)
        probs_mean_E = probs_TE.mean(0)
        aux = routing.switch_aux_loss(probs_TE, counts_E, self.cfg.top_k, probs_mean_E)
        seq_aux = self._seq_aux_loss(probs_TE, decision, shape)
        stats = self._stats(decision, counts_E, probs_TE, split, routed, xr_TD)
        return MoEOutput(
            y=y_TD.view(shape),
            aux_loss=aux,
            z_loss=routing.z_loss(decision.logits_TE),
            stats=stats,
            probs_mean_E=probs_mean_E,
            seq_aux_loss=seq_aux,
            ids_TK=decision.ids_TK,
            valid_TK=decision.valid_TK,
        )

    def _counts(self, decision: RoutingDecision, split: identity.Split, routed: RoutedRun) -> torch.Tensor:
        """Pairs routed to each selectable expert. A local plan over exactly these experts counted
        them already (from its sort of the same ids, valid pairs only, before any capacity drop): reuse
        it. Otherwise (identity experts, expert parallelism, hot replicas, the decode path) count."""
        meta = routed.meta
        if (isinstance(split, identity.NoIdentity) and isinstance(meta, LocalMeta)
                and meta.expert_of_group is None and meta.plan.num_experts == self.slots.selectable):
            return meta.plan.counts_E
        return routing.expert_counts(decision.ids_TK, self.slots.selectable, decision.valid_TK)

    def _project_down(self, x_TD: torch.Tensor) -> torch.Tensor:
        """LatentMoE: the routed experts read the latent projection of x (width l), else x itself."""
        return self.latent.project_down(x_TD) if self.latent is not None else x_TD

    def _project_up(self, y_TD: torch.Tensor) -> torch.Tensor:
        return self.latent.project_up(y_TD) if self.latent is not None else y_TD

    def _routed_experts(self, xr_TD: torch.Tensor, run: RoutingDecision, x_TD: torch.Tensor) -> RoutedRun:
        """The routed experts' weighted sum per token: the decode path when it applies
        (decode_experts.py), else dispatch, the grouped experts and combine."""
        if decode_experts.applies(self.experts, self.dispatcher, run, x_TD.shape[0],
                                  self.decode_max_tokens, self.detailed_stats):
            y_TD = decode_experts.row_sum_experts(xr_TD, run, self.experts)
            return RoutedRun(y_TD, decode_experts.no_drop_meta(run, self.slots.routed))
        batch, meta, shared_TD = self._dispatch(xr_TD, run, x_TD)
        rows_format = getattr(self.dispatcher, "rows_format", None)  # (every dispatcher's rows, one place)
        if rows_format is not None:
            batch = replace(batch, rows_format=rows_format)
        y_RD = self.experts(batch)
        return RoutedRun(self.dispatcher.combine(y_RD, meta), meta, batch, y_RD, shared_TD)

    def _dispatch(self, xr_TD: torch.Tensor, run: RoutingDecision, x_TD: torch.Tensor
                  ) -> tuple[ExpertBatch, DispatchMeta, torch.Tensor | None]:
        """Dispatch; where the dispatcher overlaps (EP, distributed/ep.py), the shared experts run
        while the token rows are in flight and come back third."""
        if self.shared is not None and self.dispatcher.overlap_shared:
            return self.dispatcher.dispatch_overlapped(xr_TD, run, lambda: self._shared(x_TD))
        batch, meta = self.dispatcher.dispatch(xr_TD, run)
        return batch, meta, None

    def _add_shared(self, y_TD: torch.Tensor, shared_TD: torch.Tensor | None, x_TD: torch.Tensor) -> torch.Tensor:
        """Plus the shared experts (in D), unless there are none; already computed when dispatch ran them."""
        if self.shared is None:
            return y_TD
        return y_TD + (shared_TD if shared_TD is not None else self._shared(x_TD))

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.recompute_shared and torch.is_grad_enabled():  # layers/recompute.py
            return recompute.recomputed(self.shared, x_TD)
        return self.shared(x_TD)

    def _seq_aux_loss(self, probs_TE: torch.Tensor, decision: RoutingDecision,
                      shape: torch.Size) -> torch.Tensor | None:
        """The sequence-scope aux loss, when its coefficient is > 0. Sequences are the second-to-last
        dim of x ([B, S, D]); a flat [T, D] input is one sequence."""
        if not self.cfg.balance.seq_aux_loss_coeff > 0:
            return None
        seq_len = shape[-2] if len(shape) >= 3 else probs_TE.shape[0]
        return balance.sequence_aux_loss(probs_TE, decision.ids_TK, seq_len, decision.valid_TK)

    def _stats(self, decision: RoutingDecision, counts_E: torch.Tensor, probs_TE: torch.Tensor,
               split: identity.Split, routed: RoutedRun,
               xr_TD: torch.Tensor) -> MoEStats:
        extra: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            if self.detailed_stats:
                extra["out_sq_E"] = split.out_sq(routed.out_sq(self.slots.routed), xr_TD)
                extra["router_entropy"], extra["top1_top2_ratio"] = router_summaries(probs_TE)
            if self.cfg.router.strategy == "expert_threshold":
                extra["score_quantile_E"] = routing.score_quantile(decision.scores_TE, self.cfg.top_k)
            if self.quantile_stats:
                extra["quantile_bias_E"] = balance.quantile_bias(
                    self.router.selection_base(decision), self.cfg.top_k)
        return MoEStats(counts_E, routed.meta.pairs_dropped, routed.meta.link_demand,
                        pairs_spilled=routed.meta.pairs_spilled, **extra)
