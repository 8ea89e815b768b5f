"""Hot-expert replication in the trainer (`parallel.replicate_hot_experts`, `parallel.replica_interval`).

Legend: P EP ranks, E experts, L = E/P own experts per rank, S spare slots per rank, R replicas.

Every MoE layer's EP dispatcher becomes a `HotReplicaDispatcher` (distributed/ep_hot_replicas.py) with
S = ceil(R / (P - 1)) spare slots per rank (a copy never sits on its owner), and every layer's `slots`
gain them (expert_slots.py). The layers' per-expert counts of their routed experts (identity experts
compute nothing and need no copy; the layer counts them after the routed ones) are summed on the
device every micro-batch (no host read); every `replica_interval` steps, after the step, one
all-reduce of the interval's counts over the whole job and one host read give each layer its
placement (`plan_replicas`: the R busiest experts, hottest first, one copy each on the least-loaded
other rank). Every rank computes the same placement from the same sums. Installing it
moves no weights: the copies are fetched from their owners in every layer call (the dispatcher's
note), so the parameters, the optimizer state, the gradient norm and the checkpoints hold the E
logical experts only, and a resume with another placement or none continues the same model.
Reported per placement (a metrics row): each layer's copies (expert, rank, fraction), the load of the
busiest rank over the mean in the interval's counts before and (as planned) after, the seconds the
placement took and the bytes each layer call then fetches (weights out; the same again as gradients
back in the backward).
Not kept across a resume: the placement and the interval's counts (the first interval after a
resume runs unreplicated). A retried step (on_overflow "retry") counts its routing twice.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from ..config import ParallelConfig
from ..distributed import comm
from ..distributed.ep_hot_replicas import HotReplicaDispatcher
from ..distributed.ep_replicas import plan_replicas
from ..layers.moe import MoEStats


def _busiest_over_mean(load_P: list[float]) -> float:
    mean = sum(load_P) / len(load_P)
    return max(load_P) / mean if mean > 0 else 1.0


class HotReplicas:
    def __init__(self, layers: list[Any], group: dist.ProcessGroup, cfg: ParallelConfig,
                 device: torch.device) -> None:
        self.layers, self.group, self.device = layers, group, device
        self.num_replicas, self.interval = cfg.replicate_hot_experts, cfg.replica_interval
        slots = layers[0].slots  # sharded over the EP group (parallelize_ep.py)
        self.slots = slots.with_spare(math.ceil(self.num_replicas / (slots.ep_size - 1)))
        for layer in layers:
            layer.slots = self.slots
            layer.dispatcher = HotReplicaDispatcher.wrap(layer.dispatcher, self.slots)
        self.counts_LE = torch.zeros(len(layers), self.slots.routed, dtype=torch.int64, device=device)

    @classmethod
    def build(cls, model: torch.nn.Module, meshes: Any, cfg: ParallelConfig,
              device: torch.device) -> "HotReplicas | None":
        """None unless `parallel.replicate_hot_experts` > 0 (which needs ep_size > 1: config.py)."""
        if cfg.replicate_hot_experts == 0 or meshes is None or not model.moe_layers():
            return None
        return cls(model.moe_layers(), meshes.dp_group, cfg, device)

    def observe(self, stats: list[MoEStats]) -> None:
        """A micro-batch's per-expert counts (this rank's tokens) of the routed experts, summed on the device."""
        self.counts_LE += torch.stack([s.tokens_per_expert_E[:self.slots.routed] for s in stats])

    def maybe_place(self, step: int) -> dict[str, Any] | None:
        """After `step`: at every `replica_interval`-th step, the new placement (collective: every
        rank calls it at the same steps) and its report; else None."""
        if (step + 1) % self.interval:
            return None
        start = time.perf_counter()
        counts = self.counts_LE.clone()
        comm.all_reduce(counts, dist.ReduceOp.SUM, self.group)
        host = counts.tolist()  # the one host read of the interval
        self.counts_LE.zero_()
        P, S, L = self.slots.ep_size, self.slots.spare, self.slots.local
        owner = self.slots.owner
        layers, before, after, fetch_bytes = [], [], [], 0
        for layer, c in zip(self.layers, host):
            reps = plan_replicas(c, self.num_replicas, P, S)
            layer.dispatcher.set_replicas(reps, self.device)
            load = [float(sum(c[r * L:(r + 1) * L])) for r in range(P)]
            planned = list(load)
            for rep in reps:
                moved = rep.fraction * c[rep.expert]
                planned[owner(rep.expert)] -= moved
                planned[rep.rank] += moved
            before.append(round(_busiest_over_mean(load), 4))
            after.append(round(_busiest_over_mean(planned), 4))
            layers.append([(r.expert, r.rank, round(r.fraction, 4)) for r in reps])
            ex = layer.experts
            per_expert = sum(w[0].numel() * w.element_size() for w in (ex.w_gate_up_EDF, ex.w_down_EFD))
            fetch_bytes += len(reps) * per_expert
        return {"step": step, "replica_placement": layers, "busiest_over_mean_before": before,
                "busiest_over_mean_planned": after, "replica_fetch_bytes_per_step": fetch_bytes,
                "replica_place_s": round(time.perf_counter() - start, 6)}
