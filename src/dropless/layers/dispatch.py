"""Dispatchers: move (token, expert) pairs to the experts and their results back.

Legend: T tokens, K slots per token, D model width, E experts, R rows in expert order, G groups of
an expert batch (E here; a rank's slots under EP).

The contract, one for every dispatcher (this file's LocalDispatcher, and the expert-parallel
EPDispatcher in dropless.distributed.ep and its hot-replica forms), the `Dispatcher` protocol:

    dispatch(x_TD, decision: RoutingDecision) -> (ExpertBatch, DispatchMeta)
    dispatch_overlapped(x_TD, decision, during) -> (ExpertBatch, DispatchMeta, during() or None)
    combine(y_RD, meta) -> y_TD
    overlap_shared: bool        the layer hands its shared experts to dispatch_overlapped
    allows_decode_path: bool    the decode path (decode_experts.py) may stand in for the three calls

The layer asks a dispatcher these and nothing else; every dispatcher answers each one itself.

- `dispatch` takes the router's whole decision (ids, weights, validity mask), so no path can forget
  the mask: an invalid slot (expert choice, expert threshold) gets no row, no traffic, weight 0.
  A dispatcher that cannot honour a mask refuses it (the capacity baseline), never ignores it.
- The metadata derives from `DispatchMeta`, a frozen dataclass with what the layer reads for its
  statistics (pairs dropped, the EP link demand, the slice of experts the batch holds); the rest is
  what combine needs. So one dispatcher object serves every layer and every micro-batch, and the
  experts never know whether their rows came from this process or from other ranks.
- The routing weight is applied in ONE place for every path: in the experts. dispatch hands them
  each row's weight (`ExpertBatch.weights_R`, 0 on padding rows), GroupedExperts multiplies it into
  the activation before the down GEMM ((w * h) @ W = w * (h @ W)), and combine is an unweighted sum
  of each token's rows (`permute.unpermute`, the adjoint of permute). Why there: the weighting
  touches [R, F] activations inside the fused SwiGLU instead of [R, D] outputs, combine keeps
  nothing but indices for its backward (a gather), and an EP destination can pre-sum a token's rows
  without knowing any weight. The EP dispatcher sends each pair's weight along with the pair,
  through a differentiable all-to-all, so the router's gradient comes back the same way.
- Row alignment: the experts declare what their GEMMs need (`GroupedExperts.row_align`: a
  low-precision recipe's token block, else 1); `dispatch_align` combines it with `moe.align`, and
  both factories (`build_dispatcher` here, `distributed.ep.build_ep_dispatcher`) take it from there.
  The local dispatcher also rounds groups up to `grouped_gemm.row_bucket` rows for bf16 GEMMs on the
  CPU (oneDNN caches one kernel per shape; ragged groups would make a new one nearly every call),
  and, where the groups are nearly even, pads them all to the largest (`grouped_gemm.uniform_limit`:
  one batched matmul splits over the cores where a matmul per expert does not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from ..config import MoEConfig
from ..expert_slots import ExpertSlots
from ..ops import grouped_gemm, payload
from ..ops import permute as P
from ..ops.capacity_plan import make_capacity_plan
from ..ops.lean_experts import RowSource
from .experts import ExpertBatch, GroupedExperts
from .router import RoutingDecision


@dataclass(frozen=True, kw_only=True)
class DispatchMeta:
    """What every dispatcher's metadata tells the layer (device scalars stay on the device)."""

    # int64 scalar: valid pairs that got no row (capacity, EP overflow); None: this dispatch cannot drop
    pairs_dropped: torch.Tensor | None
    first_expert: int  # global index of the first expert of the batch's groups
    num_local: int  # groups in ExpertBatch.offsets_E: experts [first_expert, first_expert + num_local)
    link_demand: torch.Tensor | None = None  # int64 scalar: EP, most pairs routed over one link
    pairs_spilled: torch.Tensor | None = None  # int64 scalar: EP spill, pairs sent in the second exchange
    # hot-expert replicas: the global expert of each of the batch's groups (E: an unused slot); None:
    # groups are experts [first_expert, first_expert + num_local)
    expert_of_group: torch.Tensor | None = None

    def per_expert(self, v_G: torch.Tensor, num_experts: int) -> torch.Tensor:
        """A value per GEMM group of the batch as one per routed expert ([num_experts]): a replica's
        entry adds to its expert's (`expert_of_group`), experts held elsewhere (EP) get zeros."""
        E = num_experts
        if self.expert_of_group is not None:  # an unused slot's index E lands past the cut
            return v_G.new_zeros(E + 1).index_add_(0, self.expert_of_group, v_G)[:E]
        if self.num_local < E:
            return F.pad(v_G, (self.first_expert, E - self.first_expert - self.num_local))
        return v_G


@dataclass(frozen=True, kw_only=True)
class LocalMeta(DispatchMeta):
    plan: P.RoutingPlan
    src_R: torch.Tensor | None = None  # plan.src_R, computed once for permute, the experts, combine


class Dispatcher(Protocol):
    """What a MoE layer asks of its dispatcher (module note)."""

    @property
    def overlap_shared(self) -> bool:
        """Whether the layer runs its shared experts inside `dispatch_overlapped` (EP: while the token
        rows are in flight) instead of after combine."""
        ...

    @property
    def allows_decode_path(self) -> bool:
        """Whether every pair may be computed where its token is, none dropped: the decode path
        (decode_experts.py) then replaces dispatch, experts and combine. One device, dropless."""
        ...

    def dispatch(self, x_TD: torch.Tensor, decision: RoutingDecision) -> tuple[ExpertBatch, DispatchMeta]: ...

    def dispatch_overlapped(self, x_TD: torch.Tensor, decision: RoutingDecision,
                            during: Callable[[], torch.Tensor] | None
                            ) -> tuple[ExpertBatch, DispatchMeta, torch.Tensor | None]:
        """`dispatch`, with `during()` computed while the dispatch allows (its result third; None
        when `during` is None)."""
        ...

    def combine(self, y_RD: torch.Tensor, meta: DispatchMeta) -> torch.Tensor: ...


@dataclass(frozen=True)
class LocalDispatcher:
    """Single-device dispatch: a routing plan, a gather into expert order, an unweighted sum back.

    Dropless by default (capacity_factor None): every pair gets a row and no host sync happens.
    With a capacity factor it is the capacity baseline: C rows per expert, the overflow dropped.
    """

    num_experts: int
    align: int = 1
    capacity_factor: float | None = None
    drop_policy: str = "position"
    # parallel.dispatch_dtype: the rows are rounded as the EP payload would carry them (ops/payload.py),
    # so a run gives the experts the same numbers at every EP size
    payload: str = "native"

    def __post_init__(self) -> None:
        payload.check(self.payload)

    @property
    def overlap_shared(self) -> bool:
        return False  # nothing is in flight on one device

    @property
    def rows_format(self) -> str | None:
        """What the dispatched rows are exact in (ops/payload.py `exact_format`; ExpertBatch.rows_format)."""
        return payload.exact_format(self.payload)

    @property
    def allows_decode_path(self) -> bool:
        # the capacity layout drops by position in a group; the decode path would skip the payload's rounding
        return self.capacity_factor is None and self.payload == "native"

    def plan(self, decision: RoutingDecision, bucket: int = 1,
             uniform_limit: float | None = None) -> P.RoutingPlan:
        """`bucket`: a further row alignment of the dropless plan (`grouped_gemm.row_bucket`);
        `uniform_limit`: pad the groups to one size when it costs at most that factor of rows
        (`grouped_gemm.uniform_limit`)."""
        if self.capacity_factor is None:
            align = math.lcm(self.align, bucket)
            return P.make_plan(decision.ids_TK, self.num_experts, align, decision.valid_TK, uniform_limit)
        if decision.valid_TK is not None:
            raise ValueError("the capacity baseline takes token-choice routing only (valid_TK given)")
        return make_capacity_plan(decision.ids_TK, decision.weights_TK, self.num_experts,
                                    self.capacity_factor, self.drop_policy, self.align)

    def dispatch(self, x_TD: torch.Tensor, decision: RoutingDecision) -> tuple[ExpertBatch, LocalMeta]:
        bucket = grouped_gemm.row_bucket(x_TD, decision.ids_TK.numel() / self.num_experts)
        plan = self.plan(decision, bucket, grouped_gemm.uniform_limit(x_TD, bucket))
        weights_R = P.permute_weights(decision.weights_TK, plan)
        x_TD = payload.round_rows(x_TD, self.payload)
        # the source lets the lean experts re-gather x_RD in the backward instead of keeping it; its
        # row index is the one combine's backward keeps (one storage for both)
        src_R = plan.src_R
        source = RowSource(x_TD, src_R, P.has_padding(plan))
        batch = ExpertBatch(P.permute(x_TD, plan, src_R), plan.offsets_E, plan.capacity, weights_R, source)
        return batch, LocalMeta(pairs_dropped=plan.pairs_dropped(), first_expert=0,
                                num_local=self.num_experts, plan=plan, src_R=src_R)

    def dispatch_overlapped(self, x_TD: torch.Tensor, decision: RoutingDecision,
                            during: Callable[[], torch.Tensor] | None
                            ) -> tuple[ExpertBatch, LocalMeta, torch.Tensor | None]:
        """Nothing is in flight on one device: `dispatch`, then `during()`."""
        batch, meta = self.dispatch(x_TD, decision)
        return batch, meta, during() if during is not None else None

    def combine(self, y_RD: torch.Tensor, meta: LocalMeta) -> torch.Tensor:
        return P.unpermute(y_RD, meta.plan, meta.src_R)


def dispatch_align(cfg: MoEConfig, experts: GroupedExperts) -> int:
    """The row alignment of every dispatcher of this layer: `cfg.align` and the experts' own need."""
    return math.lcm(cfg.align, experts.row_align)


def build_dispatcher(cfg: MoEConfig, experts: GroupedExperts, slots: ExpertSlots) -> LocalDispatcher:
    """The single-device dispatcher of a layer (expert parallelism: distributed.ep.build_ep_dispatcher):
    one group per routed expert (identity experts never reach a dispatcher, layers/identity.py)."""
    return LocalDispatcher(slots.routed, dispatch_align(cfg, experts), cfg.capacity_factor,
                           cfg.drop_policy)
