"""Hot-expert replication for expert parallelism: the placement and routing both forms share, and the
layer-level form with the copies as parameters (`replicate_layer` ... `sync_replica_grads`). The
trainer's form, with the copies fetched from their owners each call, is ep_hot_replicas.py
(`HotReplicaDispatcher`; train/ep_replicas_train.py).

Legend: P ranks, E experts, L = E/P own experts per rank, S spare slots per rank, T tokens, K slots.
    virtual slot v in [0, P*(L+S)): rank v // (L+S), local slot v % (L+S); a rank's slots are its L
    own experts (global r*L + l at slot l), then its S spare slots (expert_slots.py's physical slots:
    the layer's `slots` carry P and S once replicated, and every count here is read from them)
Identity experts (layers/identity.py) get no copies: they compute nothing, and their pairs never
reach a dispatcher (they are invalid slots of the decision it sees), so only the E routed experts'
counts are planned over.

Under skewed routing the rank that owns a hot expert is every step's straggler. Replication gives the
R busiest experts (global counts) a copy in a spare slot on another rank and sends part of each one's
pairs there:
- Placement (`plan_replicas`, host, at the caller's interval): for each of the R busiest experts,
  hottest first, the least-loaded other rank with a free spare slot gets a copy, and the fraction of
  the expert's pairs sent to it equalises the two ranks' loads as far as the expert's own load allows
  (an even split cannot: measured under Zipf 1.0 it leaves the busiest rank at 1.2-1.3x the mean).
- Routing (`virtual_ids`, device, no host read): a pair of token t for a replicated expert goes to
  the copy when frac(t * golden ratio) < the copy's fraction (a low-discrepancy split of each
  rank's tokens), else to the owner. The EP dispatcher then runs over the P*(L+S) virtual slots,
  unchanged: the GEMM sees L+S groups.
- Weights (`apply_placement`): the owner broadcasts the expert's weights and, given an optimizer, its
  AdamW moments into the copy's slot; slots without a copy are zeroed. Reported: bytes and seconds.
- Gradients (`sync_replica_grads`, after the backward): per copy, one all-reduce of the owner's and
  the copy's gradient (the other ranks add zeros); both slots get the sum, which is the expert's full
  gradient, so with identical weights and moments the optimizer keeps the copies bit-identical.
Numerics: an expert's pairs are split over two GEMMs and its gradient summed in two parts, so
outputs and gradients match the unreplicated layer at the EP noise floor (tolerances.EP_REDUCED).
The layer-level form does not support `detailed_stats`, the trainer, FSDP over the expert weights or
checkpoints (its spare slots are parameters outside the [E, ...] checkpoint layout); the fetched
form has none of these limits (its class note).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..expert_slots import ExpertSlots
from ..layers.experts import ExpertBatch
from ..layers.moe import MoELayer
from ..layers.router import RoutingDecision
from .ep import EPDispatcher
from .ep_exchange import EPMeta

GOLDEN = (math.sqrt(5) - 1) / 2
WEIGHTS = ("w_gate_up_EDF", "w_down_EFD")


@dataclass(frozen=True)
class Replica:
    expert: int
    rank: int  # where the copy lives
    slot: int  # its spare slot there, in [0, S)
    fraction: float  # of the expert's pairs sent to the copy


def plan_replicas(counts_E: list[int], num_replicas: int, ep_size: int, spare: int) -> tuple[Replica, ...]:
    """The R busiest experts' copies, placed greedily (module note); deterministic in the counts."""
    E = len(counts_E)
    L = E // ep_size
    load = [float(sum(counts_E[r * L:(r + 1) * L])) for r in range(ep_size)]
    free = [spare] * ep_size
    out = []
    for e in sorted(range(E), key=lambda i: (-counts_E[i], i))[:num_replicas]:
        owner, c = e // L, float(counts_E[e])
        cand = [r for r in range(ep_size) if r != owner and free[r] > 0]
        if not cand or c == 0:
            continue
        r = min(cand, key=lambda i: (load[i], i))
        moved = min(c, max(0.0, (load[owner] - load[r]) / 2))
        if moved == 0:  # the owner is no busier than any rank with a slot: a copy would carry nothing
            continue
        out.append(Replica(e, r, spare - free[r], moved / c))
        free[r] -= 1
        load[owner] -= moved
        load[r] += moved
    return tuple(out)


def slot_tables(replicas: tuple[Replica, ...], slots: ExpertSlots,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(owner slot per routed expert, copy slot per routed expert (= owner without a copy), fraction
    per routed expert), physical slots of `slots`."""
    owner = slots.owner_slot(torch.arange(slots.routed))
    copy, frac = owner.clone(), torch.zeros(slots.routed)
    for rep in replicas:
        copy[rep.expert] = slots.spare_slot(rep.rank, rep.slot)
        frac[rep.expert] = rep.fraction
    return owner.to(device), copy.to(device), frac.to(device)


def virtual_ids(ids_TK: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Each pair's virtual slot: the copy for a `fraction` of each replicated expert's tokens."""
    owner, copy, frac = tables
    T = ids_TK.shape[0]
    u_T = torch.frac(torch.arange(T, device=ids_TK.device, dtype=torch.float64) * GOLDEN).float()
    to_copy = u_T[:, None] < frac[ids_TK]
    return torch.where(to_copy, copy[ids_TK], owner[ids_TK])


class ReplicatedDispatcher:
    """The dispatcher contract over virtual slots (an EPDispatcher over P*(L+S) of them)."""

    def __init__(self, inner: EPDispatcher, slots: ExpertSlots) -> None:
        self.inner, self.slots = inner, slots
        self.replicas: tuple[Replica, ...] = ()
        self.tables = slot_tables((), slots, torch.device("cpu"))

    def set_replicas(self, replicas: tuple[Replica, ...], device: torch.device) -> None:
        self.replicas = replicas
        self.tables = slot_tables(replicas, self.slots, device)

    @property
    def overlap_shared(self) -> bool:
        return self.inner.overlap_shared

    @property
    def allows_decode_path(self) -> bool:
        return False  # the pairs travel to the ranks that hold their experts

    def dispatch(self, x_TD: torch.Tensor, decision: RoutingDecision) -> tuple[ExpertBatch, EPMeta]:
        ids = virtual_ids(decision.ids_TK, self.tables)
        return self.inner.dispatch(x_TD, replace(decision, ids_TK=ids))

    def dispatch_overlapped(self, x_TD: torch.Tensor, decision: RoutingDecision,
                            during: Callable[[], torch.Tensor] | None
                            ) -> tuple[ExpertBatch, EPMeta, torch.Tensor | None]:
        ids = virtual_ids(decision.ids_TK, self.tables)
        return self.inner.dispatch_overlapped(x_TD, replace(decision, ids_TK=ids), during)

    def combine(self, y_RD: torch.Tensor, meta: EPMeta) -> torch.Tensor:
        return self.inner.combine(y_RD, meta)


def replicate_layer(layer: MoELayer, group: ProcessGroup | None, spare: int) -> MoELayer:
    """Give an EP-sharded layer (`shard_moe_layer`) S zeroed spare expert slots and a replicating
    dispatcher (no copies until `apply_placement`)."""
    inner = layer.dispatcher
    if not isinstance(inner, EPDispatcher):
        raise ValueError("replicate_layer: shard the layer with shard_moe_layer first")
    if spare < 1:
        raise ValueError(f"spare={spare}: must be >= 1")
    slots = layer.slots.with_spare(spare)
    virt = inner.plain(num_experts=slots.physical)  # L + S groups per rank
    with torch.no_grad():
        for name in WEIGHTS:
            w = getattr(layer.experts, name)
            grown = torch.cat([w.detach(), w.new_zeros((spare, *w.shape[1:]))])
            setattr(layer.experts, name, nn.Parameter(grown, requires_grad=w.requires_grad))
    layer.dispatcher, layer.slots = ReplicatedDispatcher(virt, slots), slots
    return layer


def _owner_src(group: ProcessGroup | None, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


@torch.no_grad()
def apply_placement(layer: MoELayer, replicas: tuple[Replica, ...], group: ProcessGroup | None,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Install `replicas` (the same on every rank): owners broadcast weights (and AdamW moments)
    into the copies' slots, the other spare slots are zeroed. Collective. Returns the cost."""
    disp: ReplicatedDispatcher = layer.dispatcher
    L, owner_of = disp.slots.local, disp.slots.owner
    rank = dist.get_rank(group)
    start, nbytes = time.perf_counter(), 0
    for name in WEIGHTS:
        p = getattr(layer.experts, name)
        tensors = [p.data]
        if optimizer is not None and p in optimizer.state:
            tensors += [optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq") if k in optimizer.state[p]]
        for t in tensors:
            t[L:].zero_()
            for rep in replicas:
                owner = owner_of(rep.expert)
                buf = t[rep.expert % L].clone() if rank == owner else torch.empty_like(t[0])
                dist.broadcast(buf, _owner_src(group, owner), group=group)
                nbytes += buf.numel() * buf.element_size()
                if rank == rep.rank:
                    t[L + rep.slot].copy_(buf)
    disp.set_replicas(replicas, layer.experts.w_gate_up_EDF.device)
    return {"replicas": [(r.expert, r.rank, round(r.fraction, 4)) for r in replicas],
            "bytes_broadcast": nbytes, "seconds": time.perf_counter() - start}


@torch.no_grad()
def sync_replica_grads(layer: MoELayer, group: ProcessGroup | None) -> None:
    """After the backward: owner and copy both get the sum of their gradients. Collective."""
    disp: ReplicatedDispatcher = layer.dispatcher
    L = disp.slots.local
    rank = dist.get_rank(group)
    for name in WEIGHTS:
        g = getattr(layer.experts, name).grad
        for rep in disp.replicas:
            owner = disp.slots.owner(rep.expert)
            if rank == owner:
                buf = g[rep.expert % L].clone()
            elif rank == rep.rank:
                buf = g[L + rep.slot].clone()
            else:
                buf = torch.zeros_like(g[0])
            dist.all_reduce(buf, group=group)
            if rank == owner:
                g[rep.expert % L].copy_(buf)
            elif rank == rep.rank:
                g[L + rep.slot].copy_(buf)
