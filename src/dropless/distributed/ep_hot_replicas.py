"""Hot-expert replicas for the trainer: the EP dispatcher over virtual slots whose copies are fetched
from their owners each call, never kept as parameters (train/ep_replicas_train.py installs it).

The placement, the routing of pairs to copies and the legend (P ranks, L own experts and S spare
slots per rank) are ep_replicas.py's, shared with the layer-level form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..expert_slots import ExpertSlots
from ..layers.experts import ExpertBatch
from ..layers.router import RoutingDecision
from . import comm
from .ep import EPDispatcher
from .ep_exchange import EPMeta
from .ep_replicas import Replica, slot_tables, virtual_ids

@dataclass(frozen=True)
class Placement:
    """One placement of the copies, as one rank's tables (the same replicas on every rank)."""

    replicas: tuple[Replica, ...]
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # `virtual_ids`' tables
    send_idx: torch.Tensor  # own experts whose weights this rank sends, by destination
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    slot_row: torch.Tensor  # received row of each spare slot (the zero row when it holds no copy)
    expert_of_group: torch.Tensor  # DispatchMeta.expert_of_group: the expert of each of the L+S groups

    @classmethod
    def build(cls, replicas: tuple[Replica, ...], slots: ExpertSlots, me: int, device: torch.device) -> "Placement":
        """Host tables, nothing moves."""
        P, L, S = slots.ep_size, slots.local, slots.spare
        order = sorted(replicas, key=lambda r: (r.rank, r.slot))
        mine = [r for r in order if r.expert // L == me]  # copies this rank's experts feed, by destination
        got = sorted((r for r in replicas if r.rank == me), key=lambda r: (r.expert // L, r.slot))
        row = {r.slot: i for i, r in enumerate(got)}
        E = slots.routed  # a spare slot without a copy: the index past the routed experts
        groups = list(range(me * L, (me + 1) * L)) + [E] * S
        for r in got:
            groups[L + r.slot] = r.expert
        def ints(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64, device=device)

        return cls(replicas, slot_tables(replicas, slots, device), ints([r.expert % L for r in mine]),
                   tuple(sum(r.rank == d for r in mine) for d in range(P)),
                   tuple(sum(r.expert // L == o for r in got) for o in range(P)),
                   ints([row.get(s, len(got)) for s in range(S)]), ints(groups))


@dataclass(eq=False, kw_only=True)
class HotReplicaDispatcher(EPDispatcher):
    """The EP dispatcher over P*(L+S) virtual slots whose copies are fetched, not kept.

    The trainer's expert parameters stay the L logical experts per rank (FSDP over edp, checkpoints,
    the optimizer and the gradient norm see nothing new). Each call fetches the copies' weights from
    their owners: one differentiable all-to-all per weight over the EP group (`grow`, run by the
    experts on their unsharded weights through `ExpertBatch.grow`), appended as the S spare groups
    (zeros where a slot holds no copy). Its backward sends each copy's gradient back to its owner,
    where autograd adds it to the owner's own: the gradient of the expert is the sum over both
    copies, counted once, and the copies are the owner's weights at every step by construction (no
    state to keep identical). Cost per layer call: the copies' weights out and their gradients back
    (R expert weights each way, summed over ranks), plus a [L+S, ...] concatenation of the weights.
    Its variants (`exact`, `worst_case`) keep the placement.
    """

    slots: ExpertSlots  # the layer's, with its spare slots set
    placement: Placement | None = None  # None: no copies yet (built on the CPU)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.placement is None:
            self.placement = Placement.build((), self.slots, self.rank, torch.device("cpu"))

    @classmethod
    def wrap(cls, inner: EPDispatcher, slots: ExpertSlots) -> "HotReplicaDispatcher":
        """`inner` over the physical slots of `slots` (the layer's, with its spare slots set)."""
        if slots.spare < 1:
            raise ValueError(f"spare={slots.spare}: must be >= 1")
        if (slots.ep_size, slots.local) != (inner.ep_size, inner.num_local):
            raise ValueError(f"slots of {slots.ep_size} ranks x {slots.local} experts for a dispatcher of "
                             f"{inner.ep_size} ranks x {inner.num_local}")
        return cls(**{**inner.settings(), "num_experts": slots.physical}, slots=slots)

    @property
    def replicas(self) -> tuple[Replica, ...]:
        return self.placement.replicas

    def set_replicas(self, replicas: tuple[Replica, ...], device: torch.device) -> None:
        """Install a placement (the same on every rank of the group): host tables, nothing moves."""
        self.placement = Placement.build(replicas, self.slots, self.rank, device)

    def _fetch(self, w: torch.Tensor) -> torch.Tensor:
        p = self.placement
        if not p.replicas:  # every rank knows: no collective
            return torch.cat([w, w.new_zeros((self.slots.spare, *w.shape[1:]))])
        sent = w.index_select(0, p.send_idx)
        got = comm.all_to_all(sent, p.recv_splits, p.send_splits, self.group, zero_row=True)
        return torch.cat([w, got.index_select(0, p.slot_row)])

    def grow(self, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fetch(w_up), self._fetch(w_down)

    def dispatch_overlapped(self, x_TD: torch.Tensor, decision: RoutingDecision,
                            during: Callable[[], torch.Tensor] | None
                            ) -> tuple[ExpertBatch, EPMeta, torch.Tensor | None]:
        ids = virtual_ids(decision.ids_TK, self.placement.tables)
        batch, meta, extra = super().dispatch_overlapped(x_TD, replace(decision, ids_TK=ids), during)
        return replace(batch, grow=self.grow), replace(meta, expert_of_group=self.placement.expert_of_group), extra
