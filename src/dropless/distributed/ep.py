"""The expert-parallel dispatcher: the dispatcher contract of layers/dispatch.py, across ranks.

Legend: P ranks in the EP group, E experts, L = E/P local experts (rank r owns [r*L, (r+1)*L)),
T tokens on this rank, K slots per token, C per-link pair capacity (buffered mode).

This file is the dispatcher object: its settings (mode, de-dup, buffer sizing, overflow policy,
overlap), the link capacity rule, and its variants for the trainer (exact mode for evaluation,
worst-case buffers for the retry of an overflowing step), each built with `dataclasses.replace`, so a
subclass (hot-expert replicas, ep_hot_replicas.py) stays one. One layer call's collectives are
ep_exchange.py (the protocol note is there), the index maths ep_plan.py, the spill trip ep_spill.py.

Host reads: exact mode's split sizes (ep_exchange.py) and, in buffered mode with
`on_overflow="spill"`, one int per call here (the group's overflow, which decides the second trip),
except with `capturable`, where a device bool decides it and the second trip is fixed-size too
(ep_spill.py `dispatch_spill_traced`).
Buffered mode's link size is a host int: a factor of the balanced load, or with factor "auto"
`link_pairs`, which train/ep_buffers.py sets between steps.

`dispatch_dtype`: the token rows travel encoded (ops/payload.py: bf16, mxfp8 or fp8 blockwise codes
and scales) and arrive decoded, so the experts see the rows a one-process run with the same setting
sees (layers/dispatch.py `LocalDispatcher.payload`).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field, fields, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..config import EP_DISPATCH, ParallelConfig
from ..layers.dispatch import dispatch_align
from ..layers.experts import ExpertBatch
from ..layers.moe import MoELayer
from ..layers.router import RoutingDecision
from ..ops import payload
from . import ep_exchange, ep_ring, ep_spill
from .ep_exchange import EPMeta, Links
from .ep_plan import link_capacity, local_expert_count

__all__ = ["EPDispatcher", "build_ep_dispatcher", "link_capacity", "local_expert_count", "must_invalidate"]

# ragged_buffer_factor "auto" before the first check has sized the links (the fixed default's factor)
AUTO_START_FACTOR = 2.0


def must_invalidate(overflow: torch.Tensor) -> torch.Tensor:
    """True (a device bool) when a step's pairs did not all fit: its update must be skipped or rerun.

    Pass the overflow summed over layers, micro-batches and the EP group, so every rank agrees."""
    return overflow > 0


@dataclass(eq=False)
class EPDispatcher:
    """Expert-parallel dispatch over `group` (its size is the EP size; its rank picks the experts).

    mode "exact": split sizes read on the host once per call, never drops, any T per rank. mode
    "buffered": fixed per-link buffers sized for `max_tokens` tokens per rank (required), no host
    sync; overflow counted in the meta; T > max_tokens is refused from the shape, before any
    collective, on the rank that holds them: the other ranks cannot learn it without a host read, so
    they wait in the count exchange until the process group's timeout (the trainer never gets there:
    its micro-batches are the bound). `top_k`: the pairs per token the buffers are sized for (None:
    the decision's slots K; the variable-count strategies have K = E slots but about top_k pairs per
    token). `on_overflow` "spill": buffered mode sends the pairs that did not fit in a second
    exact-size exchange (ep_spill.py; `capturable`: a second fixed-size one, run on the device's
    decision); "skip" and "retry" are the trainer's business
    (train/overflow.py). `ragged_buffer_factor` "auto": the link size is `link_pairs`, set between
    steps by train/ep_buffers.py. A plain mutable dataclass: `link_pairs` changes between steps.
    """

    num_experts: int
    group: ProcessGroup | None
    _: KW_ONLY
    align: int = 1
    mode: str = "exact"
    dedup: bool = True
    ragged_buffer_factor: float | str = 2.0
    max_tokens: int = 0
    top_k: int | None = None
    on_overflow: str = "retry"
    # the layer runs its shared experts inside dispatch, while the token rows are in flight
    # (`dispatch_overlapped`; MoELayer asks for it when this is set)
    overlap_shared: bool = False
    # "auto": pair slots per link, set between steps by train/ep_buffers.py (None: AUTO_START_FACTOR)
    link_pairs: int | None = None
    # the token rows' encoding on the wire (ops/payload.py; parallel.dispatch_dtype)
    dispatch_dtype: str = "native"
    # "all_to_all", "ring" (ep_ring.py: all-gather the tokens, reduce-scatter the results), or "auto":
    # the ring where it sends fewer bytes (ep_ring.ring_sends_fewer)
    ep_dispatch: str = "all_to_all"
    # buffered mode on functional collectives: the layer traces into one graph, no host read
    # (parallel.ep_capturable; the precondition of a CUDA-graph capture)
    capturable: bool = False
    # from the group and num_experts
    ep_size: int = field(init=False)
    rank: int = field(init=False)
    num_local: int = field(init=False)

    def __post_init__(self) -> None:
        mode, factor, max_tokens = self.mode, self.ragged_buffer_factor, self.max_tokens
        if mode not in ("exact", "buffered"):
            raise ValueError(f"mode={mode!r}: must be 'exact' or 'buffered'")
        if not (factor == "auto" or factor == -1 or factor > 0):
            raise ValueError(f"ragged_buffer_factor={factor!r}: must be > 0, -1 or 'auto'")
        payload.check(self.dispatch_dtype)
        if self.capturable and (mode != "buffered" or self.dispatch_dtype != "native"
                                or self.ep_dispatch != "all_to_all"):
            raise ValueError("capturable=True: buffered mode, the native payload and the all-to-all only (got "
                             f"mode={mode!r}, dispatch_dtype={self.dispatch_dtype!r}, "
                             f"ep_dispatch={self.ep_dispatch!r})")
        if self.ep_dispatch not in EP_DISPATCH:
            raise ValueError(f"ep_dispatch={self.ep_dispatch!r}: must be one of {', '.join(EP_DISPATCH)}")
        if self.ep_dispatch != "all_to_all" and self.on_overflow == "spill" and mode == "buffered":
            raise ValueError(f"ep_dispatch={self.ep_dispatch!r} with on_overflow='spill': the spill trip is "
                             "the all-to-all's; use 'skip' or 'retry'")
        if self.on_overflow not in ("skip", "retry", "spill"):
            raise ValueError(f"on_overflow={self.on_overflow!r}: must be 'skip', 'retry' or 'spill'")
        if mode == "buffered" and max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens}: buffered EP sizes its fixed buffers from a bound on "
                             "the tokens per rank that every rank shares (parallel.max_tokens_per_rank; the "
                             "trainer fills it from train.batch_size * train.seq_len)")
        self.ep_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.num_local = local_expert_count(self.num_experts, self.ep_size)

    @property
    def rows_format(self) -> str | None:
        """What the received rows are exact in (ops/payload.py `exact_format`; ExpertBatch.rows_format)."""
        return payload.exact_format(self.dispatch_dtype)

    @property
    def allows_decode_path(self) -> bool:
        return False  # the pairs travel to the ranks that hold their experts

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first local expert."""
        return self.rank * self.num_local

    def capacity(self, num_tokens: int, top_k: int, slots: int | None = None) -> int:
        """Pair slots per link for `num_tokens` tokens per rank (buffered mode's C). "auto": the size
        the adaptive controller set (capped at the worst case), else AUTO_START_FACTOR's."""
        factor = self.ragged_buffer_factor
        if factor == "auto":
            if self.link_pairs is not None:
                return min(self.link_pairs, link_capacity(num_tokens, top_k, self.num_local, self.ep_size, -1, slots))
            factor = AUTO_START_FACTOR
        return link_capacity(num_tokens, top_k, self.num_local, self.ep_size, factor, slots)

    # -- variants ----------------------------------------------------------------------------------

    def exact(self) -> "EPDispatcher":
        """The same dispatcher in exact mode: any number of tokens per rank, never drops (one host
        read of the split sizes per call). For evaluation, where ranks may hold different batches
        (uncaptured: `capturable` is buffered mode's)."""
        return replace(self, mode="exact", capturable=False)

    def worst_case(self) -> "EPDispatcher":
        """The same dispatcher with worst-case buffers: the retry of an overflowing step."""
        return replace(self, ragged_buffer_factor=-1, link_pairs=None)

    def settings(self) -> dict[str, Any]:
        """The constructor arguments of an EPDispatcher with this one's settings."""
        return {f.name: getattr(self, f.name) for f in fields(EPDispatcher) if f.init}

    def plain(self, **changes: Any) -> "EPDispatcher":
        """An EPDispatcher (never a subclass) with these settings and `changes`: a subclass's mapping
        of the ids is left out (spill's second trip sends ids already mapped)."""
        return EPDispatcher(**{**self.settings(), **changes})

    # -- the layer call ----------------------------------------------------------------------------

    def links(self, T: int, K: int) -> Links:
        """What a call of T tokens with K slots each is sized by: buffered mode's (C, Cr) from the
        shared bound. A host check of a shape: a rank over the bound raises here, before its first
        collective."""
        C = Cr = None
        if self.mode == "buffered":
            if T > self.max_tokens:
                raise ValueError(f"{T} tokens on EP rank {self.rank} exceed max_tokens={self.max_tokens} "
                                 "(parallel.max_tokens_per_rank): buffered EP sizes its fixed buffers from "
                                 "that bound, which every rank shares. Raise it, or use parallel.ep_mode='exact'")
            C = self.capacity(self.max_tokens, self.top_k or K, K)
            Cr = min(C, self.max_tokens)
        return Links(self.group, self.ep_size, self.num_experts, self.num_local, self.first_expert,
                     self.align, self.dedup, C, Cr, C is not None and self.on_overflow == "spill",
                     self.dispatch_dtype, self.capturable)

    def uses_ring(self, width: int, dtype: torch.dtype, slots: int) -> bool:
        """Whether a call of rows of this width and dtype goes by the ring: "auto" compares the two
        protocols' bytes from sizes every rank shares (so every rank takes the same path)."""
        if self.ep_dispatch != "auto":
            return self.ep_dispatch == "ring"
        T = self.max_tokens if self.mode == "buffered" else 1024  # exact: both scale with T
        return ep_ring.ring_sends_fewer(ep_size=self.ep_size, num_experts=self.num_experts,
                                        top_k=self.top_k or slots, width=width, dtype=dtype,
                                        payload=self.dispatch_dtype, mode=self.mode, dedup=self.dedup,
                                        link_pairs=self.capacity(T, self.top_k or slots, slots), tokens=T)

    def _ring(self, x_TD: torch.Tensor, decision: RoutingDecision) -> tuple[ExpertBatch, "ep_ring.RingMeta"]:
        T, K = decision.ids_TK.shape
        block = bound = None
        if self.mode == "buffered":
            self.links(T, K)  # the shared bound's check, on the host, before any collective
            block = self.max_tokens
            bound = self.ep_size * self.capacity(self.max_tokens, self.top_k or K, K)
        return ep_ring.dispatch(x_TD, decision, self.group, first_expert=self.first_expert,
                                num_local=self.num_local, align=self.align, block=block, pair_bound=bound,
                                payload=self.dispatch_dtype)

    def dispatch(self, x_TD: torch.Tensor, decision: RoutingDecision) -> tuple[ExpertBatch, EPMeta]:
        batch, meta, _ = self.dispatch_overlapped(x_TD, decision, None)
        return batch, meta

    def dispatch_overlapped(self, x_TD: torch.Tensor, decision: RoutingDecision,
                            during: Callable[[], torch.Tensor] | None
                            ) -> tuple[ExpertBatch, EPMeta, torch.Tensor | None]:
        """`dispatch`, and `during()` (the shared experts) computed while the token rows and their
        metadata are in flight (ep_exchange.dispatch); returns its result third (None: nothing run).
        The ring runs `during()` after its gathers (nothing of it is overlapped)."""
        if self.uses_ring(x_TD.shape[1], x_TD.dtype, decision.ids_TK.shape[1]):
            batch, meta = self._ring(x_TD, decision)
            return batch, meta, during() if during is not None else None
        T, K = decision.ids_TK.shape
        links = self.links(T, K)
        batch, meta, extra, over = ep_exchange.dispatch(x_TD, decision, links, during)
        if over is not None and self.capturable:  # the second trip decided on the device, no host read
            worst = link_capacity(self.max_tokens, self.top_k or K, self.num_local, self.ep_size, -1, K)
            links2 = ep_spill.second_links(links, worst, self.max_tokens)
            if links2 is not None:
                batch, meta = ep_spill.dispatch_spill_traced(links2, x_TD, decision, over, batch, meta, self.align)
        # spill: the one host read of the mode (every rank reads the same total, so all of them take
        # the same branch and run the same collectives); its second exchange reads its own sizes
        elif over is not None and int(over.group_total):
            batch, meta = ep_spill.dispatch_spill(self.plain(mode="exact"), x_TD, decision, over.pairs_TK,
                                                  batch, meta)
        return batch, meta, extra

    def combine(self, y_RD: torch.Tensor, meta: EPMeta) -> torch.Tensor:
        """The rows back to their tokens, an unweighted sum (the experts applied the weights)."""
        if isinstance(meta, ep_spill.SpillMeta):  # the second trip's combine follows its meta
            return ep_spill.combine_spill(self, self if self.capturable else self.exact(), y_RD, meta)
        if isinstance(meta, ep_ring.RingMeta):
            return ep_ring.combine(y_RD, meta, self.group)
        return ep_exchange.combine(y_RD, meta, self.group)


def build_ep_dispatcher(layer: MoELayer, cfg: ParallelConfig, group: ProcessGroup | None) -> EPDispatcher:
    """The EP twin of layers/dispatch.py `build_dispatcher` for `layer` (built for one device): over
    its routed experts, the same row alignment (moe.align and what the experts need), buffers sized
    from `cfg.max_tokens_per_rank` and `moe.top_k`. (Two-level: ep_hier.py `build_hier_dispatcher`.)"""
    moe = layer.cfg
    return EPDispatcher(layer.slots.routed, group, align=dispatch_align(moe, layer.experts), mode=cfg.ep_mode,
                        dedup=cfg.dedup, ragged_buffer_factor=cfg.ragged_buffer_factor,
                        max_tokens=cfg.max_tokens_per_rank, top_k=moe.top_k, on_overflow=cfg.overflow_policy,
                        overlap_shared=cfg.overlap_shared, dispatch_dtype=cfg.dispatch_dtype,
                        ep_dispatch=cfg.ep_dispatch, capturable=cfg.ep_capturable)
