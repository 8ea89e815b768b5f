"""What the expert slots of a MoE layer are: the one answer every consumer asks.

Legend: E routed experts, Z identity experts, P EP ranks, L = E/P routed experts per rank, S replica
slots per rank.

    routing ids  [0, E)         routed experts: the ones with weights ([E, ...] tensors, one GEMM
                                group each), quantised, sharded and replicated
                 [E, E + Z)     identity experts (layers/identity.py): selectable like any expert,
                                they return their input and compute nothing (no weights)
    selectable   E + Z          the router's choice range and the range of every routing id: router
                                weight rows, bias, per-expert counts and aux loss, the monitor's
                                per-expert tables, a routing record's ids
    physical     P * (L + S)    under expert parallelism with hot-expert replicas
                                (distributed/ep_replicas.py): rank r's slots start at r * (L + S),
                                its L own experts (global r*L + l at slot l), then S spare slots
                                holding copies of other ranks' hot experts

Why one object: a knob that adds slots (identity experts, replicas) changes this one place, where a
consumer that re-derived its count from `moe.num_experts` would size its tables by the routed experts
alone and break on the others. The MoE layer owns its slots (`MoELayer.slots`, `MoEModel.expert_slots()`); what
shards or replicates the layer replaces them (`sharded`, `with_spare`), so the built modules stay the
truth. Code that plans before any module exists (config validation, the memory planner) builds one
with `from_config`.

Plain integers and integer arithmetic only (no torch): the config level can use it, and the mapping
methods work on ints and integer tensors alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

Ids = TypeVar("Ids")  # an int or an integer tensor


class SlotFields(Protocol):
    """What `from_config` reads of a `MoEConfig` (a protocol: the config validates through this
    module, so this module does not import the config)."""

    num_experts: int
    n_identity_experts: int


@dataclass(frozen=True)
class ExpertSlots:
    routed: int  # E: experts with weights, routing ids [0, E)
    identity: int = 0  # Z: zero-compute experts, routing ids [E, E + Z)
    ep_size: int = 1  # P: ranks the routed experts are sharded over
    spare: int = 0  # S: replica slots per rank for copies of hot experts (0 = no replicas)

    def __post_init__(self) -> None:
        for name in ("routed", "identity", "ep_size", "spare"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name in ("routed", "ep_size") else 0):
                raise ValueError(f"ExpertSlots.{name}={v!r}: must be an integer >= "
                                 f"{1 if name in ('routed', 'ep_size') else 0}")
        if self.routed % self.ep_size:
            raise ValueError(f"num_experts={self.routed} is not divisible by ep_size={self.ep_size}: expert "
                             "parallelism gives every rank the same number of experts")
        if self.spare and self.ep_size < 2:
            raise ValueError(f"ExpertSlots.spare={self.spare}: replica slots hold copies of other ranks' "
                             "experts, which needs ep_size >= 2")

    @classmethod
    def from_config(cls, moe: SlotFields) -> "ExpertSlots":
        """The slots a MoE layer of `moe` is built with (one device, no replicas)."""
        return cls(moe.num_experts, moe.n_identity_experts)

    @property
    def selectable(self) -> int:
        """The router's choice range: routed then identity experts."""
        return self.routed + self.identity

    @property
    def local(self) -> int:
        """L: routed experts each rank owns."""
        return self.routed // self.ep_size

    @property
    def local_slots(self) -> int:
        """L + S: a rank's GEMM groups (own experts, then spare slots)."""
        return self.local + self.spare

    @property
    def physical(self) -> int:
        """P * (L + S): the slots the EP dispatcher routes to."""
        return self.ep_size * self.local_slots

    def sharded(self, ep_size: int) -> "ExpertSlots":
        """These slots with the routed experts split over `ep_size` ranks (ValueError unless it divides)."""
        return replace(self, ep_size=ep_size)

    def with_spare(self, spare: int) -> "ExpertSlots":
        """These slots with `spare` replica slots on every rank."""
        return replace(self, spare=spare)

    def first_local(self, rank: int) -> int:
        """The global id of rank `rank`'s first own expert."""
        return rank * self.local

    def owner(self, expert: Ids) -> Ids:
        """The rank that owns routed expert(s) `expert`."""
        return expert // self.local

    def owner_slot(self, expert: Ids) -> Ids:
        """The physical slot of routed expert(s) `expert` on its owner."""
        return (expert // self.local) * self.local_slots + expert % self.local

    def spare_slot(self, rank: int, slot: int) -> int:
        """The physical slot of spare slot `slot` (in [0, S)) on rank `rank`."""
        return rank * self.local_slots + self.local + slot

    def is_identity(self, ids: Ids) -> Ids:
        """Whether routing id(s) `ids` are identity experts."""
        return ids >= self.routed
