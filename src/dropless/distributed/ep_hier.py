"""Two-level dispatch (`parallel.ep_hierarchy = "node"`): an EP group that spans nodes sends each
token across the slow link once per destination node, then fans it out inside that node.

Legend: P ranks in the EP group = Nn nodes x G ranks per node (EP rank r = n*G + g), L experts per
rank, LG = L*G experts per node, T tokens on this rank, K slots, D model width.
    S   rows this rank sends over its rail (one per (token, destination node); buffered: the Nn*Cn
        slots of its fixed blocks, ep_hier_buffered.py)
    B   rows it receives over its rail (tokens of the whole rail bound for its node; buffered: Nn*Cn)

The two groups: the rail of rank (n, g) is the Nn ranks (*, g), one per node (the ranks that talk
over the network, DeepEP's "same GPU index" peers); its node group is the G ranks (n, *).

Dispatch:
1. Rail trip (crosses nodes): each token goes once to every node that holds one of its experts, to
   that node's rank on this rank's rail, with its whole routing row (K expert ids as int32, -1 for an
   invalid slot, and K fp32 weights, which carry the router's gradient back). A token whose experts
   are all on its own node travels to itself: no network byte.
2. Node trip: the receiving rank keeps the slots whose experts live on its node and hands the B rows
   with that decision to an EPDispatcher in the same mode over its node group (the flat protocol of
   ep_exchange.py inside the node: de-dup per rank, expert-major layout, alignment, payload).
Combine reverses it: the node dispatcher's combine reduces a token's pairs inside the node (one row
per received token), the rail trip sends that one row back, and the source sums its rows per token,
in node order (`BagSum`). Both sums re-associate the one-process sum: fp32 noise.

Payload (parallel.dispatch_dtype): the rail trip carries the encoded rows; the node trip encodes
the decoded rows again, which for mxfp8 and bf16 gives the same numbers (MX rounding is idempotent,
ops/payload.py) and for fp8 blockwise may round a second time.

Modes: in exact mode (this file's rail trip) the rail's split sizes are read on the host (its count
exchange) and the node dispatcher is exact. Buffered mode (ep_hier_buffered.py: its block sizes,
overflow per level and spill) gives each rail link a fixed block of rows and the node dispatcher
fixed link blocks: no host read, unless on_overflow "spill" (the node dispatcher's one read).
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
from . import ep_hier_buffered as hb
from .ep import EPDispatcher
from .ep_hier_buffered import RailTrip
from .ep_plan import BagSum, bags
from .ep_ring import _SLOT_BYTES  # per slot of a routing row: int32 expert id + fp32 weight


@dataclass(frozen=True, kw_only=True)
class HierMeta(DispatchMeta):
    inner: DispatchMeta  # the node dispatcher's
    node_size: int  # G
    num_tokens: int
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None  # the rail trip's (out, in) row splits; None: fixed
    seg_S: torch.Tensor  # token of each sent row (for the per-token sum of the returned rows); T: none
    row_bags: tuple[torch.Tensor, torch.Tensor]
    rail_dropped: torch.Tensor  # pairs of the rows past a rail block (buffered; in pairs_dropped too)
    bytes_sent: torch.Tensor  # both trips' rows and metadata
    bytes_sent_without_dedup: torch.Tensor
    bytes_back: torch.Tensor
    bytes_inter_node: torch.Tensor  # the rail trip's bytes to other nodes (buffered: the whole blocks)

    @property
    def overflow(self) -> torch.Tensor:
        return self.pairs_dropped


def rail_exact(x_TD: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, node_TK: torch.Tensor,
               nodes: int, node_me: int, group: ProcessGroup | None, payload: str) -> RailTrip:
    """The rail trip with its split sizes read on the host: one row per (token, destination node),
    node-major, token order inside."""
    T, Nn, dev = ids_TK.shape[0], nodes, x_TD.device
    hit_TN = torch.zeros(T, Nn + 1, dtype=torch.bool, device=dev).scatter_(1, node_TK, True)[:, :Nn]
    key = torch.where(hit_TN.T, torch.arange(Nn, device=dev)[:, None], Nn).reshape(-1)
    order = torch.sort(key, stable=True).indices
    sent_N = hit_TN.sum(0)
    recv_N = comm.all_to_all_fixed(sent_N, group)
    host = torch.cat([sent_N, recv_N]).tolist()  # the one host read of the rail trip
    out_s, in_s = tuple(host[:Nn]), tuple(host[Nn:])
    S = sum(out_s)
    token_S = order[:S] % max(T, 1)
    x_BD = comm.all_to_all(x_TD.index_select(0, token_S), in_s, out_s, group, payload=payload)
    w_BK = comm.all_to_all(w_TK.index_select(0, token_S), in_s, out_s, group)
    ids_BK = comm.all_to_all(ids_TK.to(torch.int32).index_select(0, token_S), in_s, out_s, group)
    return RailTrip(x_BD, w_BK, ids_BK, token_S, (out_s, in_s), S, S - out_s[node_me],
                    x_TD.new_zeros((), dtype=torch.int64))


@dataclass(eq=False)
class HierEPDispatcher(EPDispatcher):
    """EPDispatcher over `group` (Nn x G ranks) by two trips: over the rail, then inside the node."""

    _: KW_ONLY
    node_group: ProcessGroup | None = None
    rail_group: ProcessGroup | None = None
    node_size: int = 1  # G
    inner: EPDispatcher = field(init=False)
    rail_rows: int = field(init=False)  # Cn, row slots per rail link (buffered; 0 in exact mode)

    def __post_init__(self) -> None:
        super().__post_init__()
        G = self.node_size
        if G < 1 or self.ep_size % G:
            raise ValueError(f"node_size={G}: must divide the EP size {self.ep_size}")
        if dist.get_world_size(self.node_group) != G or dist.get_world_size(self.rail_group) != self.ep_size // G:
            raise ValueError(f"the node group must have node_size={G} ranks and the rail ep_size/node_size="
                             f"{self.ep_size // G}")
        if self.capturable:
            raise ValueError("capturable=True: the two-level dispatch is not built on functional collectives")
        common = dict(align=self.align, mode=self.mode, dedup=self.dedup, top_k=self.top_k,
                      dispatch_dtype=self.dispatch_dtype, overlap_shared=self.overlap_shared)
        self.rail_rows = 0
        if self.mode == "buffered":  # the two levels' blocks (ep_hier_buffered.py)
            factor = self.ragged_buffer_factor
            hb.check_sizing(factor, self.top_k)
            Nn = self.ep_size // G
            self.rail_rows = hb.rail_rows(self.max_tokens, self.top_k, self.num_experts, Nn,
                                          -1 if self.on_overflow == "spill" else factor)
            pairs = hb.node_link_pairs(self.max_tokens, self.top_k, G, factor)
            sizing = dict(ragged_buffer_factor=-1) if pairs is None else dict(ragged_buffer_factor="auto",
                                                                              link_pairs=pairs)
            common.update(max_tokens=Nn * self.rail_rows, on_overflow=self.on_overflow, **sizing)
        self.inner = EPDispatcher(self.num_local * G, self.node_group, **common)

    def capacity(self, num_tokens: int, top_k: int, slots: int | None = None) -> int:
        """Pair slots per node link (the node dispatcher's C, what `link_demand` measures) for
        `num_tokens` tokens per rank (ep_hier_buffered.py)."""
        factor, G = self.ragged_buffer_factor, self.node_size
        hb.check_sizing(factor, top_k)
        Nn = self.ep_size // G
        Cn = hb.rail_rows(num_tokens, top_k, self.num_experts, Nn, -1 if self.on_overflow == "spill" else factor)
        worst = Nn * Cn * min(top_k if slots is None else slots, self.num_local)
        pairs = hb.node_link_pairs(num_tokens, top_k, G, factor)
        return worst if pairs is None else min(worst, pairs)

    def dispatch_overlapped(self, x_TD: torch.Tensor, decision: RoutingDecision,
                            during: Callable[[], torch.Tensor] | None
                            ) -> tuple[ExpertBatch, HierMeta, torch.Tensor | None]:
        G, L = self.node_size, self.num_local
        Nn, LG = self.ep_size // G, L * G
        node_me = self.rank // G
        T, K = decision.ids_TK.shape
        D = x_TD.shape[1]
        valid_TK = decision.valid_TK if decision.valid_TK is not None else torch.ones_like(decision.ids_TK, dtype=torch.bool)
        ids_TK = torch.where(valid_TK, decision.ids_TK, -1)
        node_TK = torch.where(valid_TK, ids_TK // LG, Nn)
        w_TK = decision.weights_TK.float()
        # 1. the rail trip: one row per (token, destination node), with its routing row
        if self.mode == "buffered":
            self.links(T, K)  # the shared bound's check, on the host, before any collective
            rail = hb.rail_buffered(x_TD, w_TK, ids_TK, node_TK, Nn, self.rail_rows, self.rail_group,
                                    self.dispatch_dtype)
        else:
            rail = rail_exact(x_TD, w_TK, ids_TK, node_TK, Nn, node_me, self.rail_group, self.dispatch_dtype)
        # 2. the node trip: the slots whose experts live on this node
        ids_BK, w_BK = rail.ids_BK, rail.w_BK
        mine = (ids_BK >= 0) & (ids_BK.long() // LG == node_me)
        local_ids = torch.where(mine, ids_BK.long() - node_me * LG, 0)
        B = rail.x_BD.shape[0]
        inner_dec = RoutingDecision(local_ids, torch.where(mine, w_BK, 0.0), w_BK.new_zeros((B, LG)),
                                    w_BK.new_zeros((B, LG)), mine)
        batch, inner_meta, extra = self.inner.dispatch_overlapped(rail.x_BD, inner_dec, during)

        rb = _payload.row_bytes(self.dispatch_dtype, D, x_TD.dtype)
        gb = D * (x_TD.element_size() if self.dispatch_dtype == "native" else 2)
        S = rail.rows_sent
        rail_bytes = S * (rb + K * _SLOT_BYTES)
        node_sent, node_plain, node_back = hb.node_bytes(inner_meta)
        meta = HierMeta(pairs_dropped=rail.dropped + inner_meta.pairs_dropped, first_expert=self.first_expert,
                        num_local=L, link_demand=inner_meta.link_demand, pairs_spilled=inner_meta.pairs_spilled,
                        inner=inner_meta, node_size=G, num_tokens=T, splits=rail.splits,
                        seg_S=rail.token_S, row_bags=bags(rail.token_S, T), rail_dropped=rail.dropped,
                        bytes_sent=node_sent + rail_bytes, bytes_sent_without_dedup=node_plain + rail_bytes,
                        bytes_back=node_back + S * (gb + K * 4),
                        bytes_inter_node=x_TD.new_full((), rail.rows_away * (rb + K * _SLOT_BYTES),
                                                       dtype=torch.int64))
        return batch, meta, extra

    def combine(self, y_RD: torch.Tensor, meta: HierMeta) -> torch.Tensor:
        """Reduce inside the node, one row per received token back over the rail, sum per token."""
        y_B = self.inner.combine(y_RD, meta.inner)
        if meta.splits is None:  # buffered: the blocks come back whole (an empty slot's row is zero)
            y_S = comm.all_to_all_fixed(y_B, self.rail_group)
        else:
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
                            dedup=cfg.dedup, ragged_buffer_factor=cfg.ragged_buffer_factor,
                            max_tokens=cfg.max_tokens_per_rank, top_k=moe.top_k, on_overflow=cfg.overflow_policy,
                            overlap_shared=cfg.overlap_shared, dispatch_dtype=cfg.dispatch_dtype,
                            node_group=hier[0], rail_group=hier[1], node_size=dist.get_world_size(hier[0]))
