"""Two-level dispatch (`parallel.ep_hierarchy = "node"`): an EP group that spans nodes sends each
token across the slow link once per destination node, then fans it out inside that node.

Legend: P ranks in the EP group = Nn nodes x G ranks per node (EP rank r = n*G + g), L experts per
rank, LG = L*G experts per node, T tokens on this rank, K slots, D model width.
    S   rows this rank sends over its rail (one per (token, destination node))
    B   rows it receives over its rail (tokens of the whole rail bound for its node)

The two groups: the rail of rank (n, g) is the Nn ranks (*, g), one per node (the ranks that talk
over the network, DeepEP's "same GPU index" peers); its node group is the G ranks (n, *).

Dispatch:
1. Rail trip (crosses nodes): each token goes once to every node that holds one of its experts, to
   that node's rank on this rank's rail, with its whole routing row (K expert ids as int32, -1 for an
   invalid slot, and K fp32 weights, which carry the router's gradient back). Split sizes are read on
   the host (the rail's count exchange), as exact mode does. A token whose experts are all on its own
   node travels to itself: no network byte.
2. Node trip: the receiving rank keeps the slots whose experts live on its node and hands the B rows
   with that decision to an exact-mode EPDispatcher over its node group (the flat protocol of
   ep_exchange.py inside the node: de-dup per rank, expert-major layout, alignment, payload).
Combine reverses it: the node dispatcher's combine reduces a token's pairs inside the node (one row
per received token), the rail trip sends that one row back, and the source sums its rows per token,
in node order (`BagSum`). Both sums re-associate the one-process sum: fp32 noise.

Payload (parallel.dispatch_dtype): the rail trip carries the encoded rows; the node trip encodes
the decoded rows again, which for mxfp8 and bf16 gives the same numbers (MX rounding is idempotent,
ops/payload.py) and for fp8 blockwise may round a second time.

Exact mode only: the buffered mode's fixed buffers, overflow guard and spill are not built per level
(config.py refuses ep_mode "buffered" with this hierarchy).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..layers.dispatch import DispatchMeta
from ..layers.experts import ExpertBatch
from ..layers.router import RoutingDecision
from ..ops import payload as _payload
from ..config import ParallelConfig
from ..layers.dispatch import dispatch_align
from ..layers.moe import MoELayer
from . import comm
from .ep import EPDispatcher
from .ep_plan import BagSum, bags
from .ep_ring import _SLOT_BYTES  # per slot of a routing row: int32 expert id + fp32 weight


@dataclass(frozen=True, kw_only=True)
class HierMeta(DispatchMeta):
    inner: DispatchMeta  # the node dispatcher's
    node_size: int  # G
    num_tokens: int
    splits: tuple[tuple[int, ...], tuple[int, ...]]  # the rail trip's (out, in) row splits
    seg_S: torch.Tensor  # token of each sent row (for the per-token sum of the returned rows)
    row_bags: tuple[torch.Tensor, torch.Tensor]
    bytes_sent: torch.Tensor  # both trips' rows and metadata
    bytes_sent_without_dedup: torch.Tensor
    bytes_back: torch.Tensor
    bytes_inter_node: torch.Tensor  # the rail trip's bytes to other nodes

    @property
    def overflow(self) -> torch.Tensor:
        return self.pairs_dropped


@dataclass(eq=False)
class HierEPDispatcher(EPDispatcher):
    """EPDispatcher over `group` (Nn x G ranks) by two trips: over the rail, then inside the node."""

    _: KW_ONLY
    node_group: ProcessGroup | None = None
    rail_group: ProcessGroup | None = None
    node_size: int = 1  # G
    inner: EPDispatcher = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode != "exact":
            raise ValueError(f"mode={self.mode!r}: two-level dispatch reads its split sizes on the host "
                             "(exact mode); buffered two-level buffers are not built")
        G = self.node_size
        if G < 1 or self.ep_size % G:
            raise ValueError(f"node_size={G}: must divide the EP size {self.ep_size}")
        if dist.get_world_size(self.node_group) != G or dist.get_world_size(self.rail_group) != self.ep_size // G:
            raise ValueError(f"the node group must have node_size={G} ranks and the rail ep_size/node_size="
                             f"{self.ep_size // G}")
        self.inner = EPDispatcher(self.num_local * G, self.node_group, align=self.align, mode="exact",
                                  dedup=self.dedup, dispatch_dtype=self.dispatch_dtype,
                                  overlap_shared=self.overlap_shared)

    def dispatch_overlapped(self, x_TD: torch.Tensor, decision: RoutingDecision,
                            during: Callable[[], torch.Tensor] | None
                            ) -> tuple[ExpertBatch, HierMeta, torch.Tensor | None]:
        G, L = self.node_size, self.num_local
        Nn, LG = self.ep_size // G, L * G
        node_me = self.rank // G
        T, K = decision.ids_TK.shape
        D, dev = x_TD.shape[1], x_TD.device
        valid_TK = decision.valid_TK if decision.valid_TK is not None else torch.ones_like(decision.ids_TK, dtype=torch.bool)
        ids_TK = torch.where(valid_TK, decision.ids_TK, -1)
        # 1. the rail trip: one row per (token, destination node), node-major, token order inside
        node_TK = torch.where(valid_TK, ids_TK // LG, Nn)
        hit_TN = torch.zeros(T, Nn + 1, dtype=torch.bool, device=dev).scatter_(1, node_TK, True)[:, :Nn]
        key = torch.where(hit_TN.T, torch.arange(Nn, device=dev)[:, None], Nn).reshape(-1)
        order = torch.sort(key, stable=True).indices
        sent_N = hit_TN.sum(0)
        recv_N = comm.all_to_all_fixed(sent_N, self.rail_group)
        host = torch.cat([sent_N, recv_N]).tolist()  # the one host read of the rail trip
        out_s, in_s = tuple(host[:Nn]), tuple(host[Nn:])
        S = sum(out_s)
        token_S = order[:S] % max(T, 1)
        x_recv = comm.all_to_all(x_TD.index_select(0, token_S), in_s, out_s, self.rail_group,
                                 payload=self.dispatch_dtype)
        w_recv = comm.all_to_all(decision.weights_TK.float().index_select(0, token_S), in_s, out_s, self.rail_group)
        ids_recv = comm.all_to_all(ids_TK.to(torch.int32).index_select(0, token_S), in_s, out_s, self.rail_group)
        # 2. the node trip: the slots whose experts live on this node
        mine = (ids_recv >= 0) & (ids_recv.long() // LG == node_me)
        local_ids = torch.where(mine, ids_recv.long() - node_me * LG, 0)
        B = x_recv.shape[0]
        inner_dec = RoutingDecision(local_ids, torch.where(mine, w_recv, 0.0), w_recv.new_zeros((B, LG)),
                                    w_recv.new_zeros((B, LG)), mine)
        batch, inner_meta, extra = self.inner.dispatch_overlapped(x_recv, inner_dec, during)

        rb = _payload.row_bytes(self.dispatch_dtype, D, x_TD.dtype)
        gb = D * (x_TD.element_size() if self.dispatch_dtype == "native" else 2)
        rail = S * (rb + K * _SLOT_BYTES)
        away = (S - out_s[node_me]) * (rb + K * _SLOT_BYTES)
        i64 = dict(dtype=torch.int64)
        meta = HierMeta(pairs_dropped=inner_meta.pairs_dropped, first_expert=self.first_expert, num_local=L,
                        link_demand=inner_meta.link_demand, inner=inner_meta, node_size=G, num_tokens=T,
                        splits=(out_s, in_s),
                        seg_S=token_S, row_bags=bags(token_S, T),
                        bytes_sent=inner_meta.bytes_sent + rail,
                        bytes_sent_without_dedup=inner_meta.bytes_sent_without_dedup + rail,
                        bytes_back=inner_meta.bytes_back + S * (gb + K * 4),
                        bytes_inter_node=x_TD.new_full((), away, **i64))
        return batch, meta, extra

    def combine(self, y_RD: torch.Tensor, meta: HierMeta) -> torch.Tensor:
        """Reduce inside the node, one row per received token back over the rail, sum per token."""
        y_B = self.inner.combine(y_RD, meta.inner)
        out_s, in_s = meta.splits
        y_S = comm.all_to_all(y_B, out_s, in_s, self.rail_group)
        return BagSum.apply(y_S, meta.seg_S, meta.row_bags, meta.num_tokens)


def build_hier_dispatcher(layer: MoELayer, cfg: ParallelConfig, group: ProcessGroup | None,
                          hier: tuple[ProcessGroup, ProcessGroup] | None) -> HierEPDispatcher:
    """ep.py `build_ep_dispatcher`'s two-level form: `hier` is (node group, rail group), mesh.py
    `ep_hier_groups`."""
    if hier is None:
        raise ValueError("parallel.ep_hierarchy='node' needs the node and rail groups (mesh.py ep_hier_groups)")
    moe = layer.cfg
    return HierEPDispatcher(layer.slots.routed, group, align=dispatch_align(moe, layer.experts), mode=cfg.ep_mode,
                            dedup=cfg.dedup, max_tokens=cfg.max_tokens_per_rank, top_k=moe.top_k,
                            overlap_shared=cfg.overlap_shared, dispatch_dtype=cfg.dispatch_dtype,
                            node_group=hier[0], rail_group=hier[1], node_size=dist.get_world_size(hier[0]))
