"""The expert-parallel all-to-all buffers, in the planner's arithmetic (model.py's note, component
`ep_buffers`, says what they count): the rows the EP dispatcher's expert GEMMs see (`ep_rows`, which
activations.py measures the experts on) and the bytes of one MoE layer's exchanges.

Legend: P = ep_size, E experts, L = E / P local experts, K experts per token, D the rows' width.
"""

from __future__ import annotations

import math

from ..config import RunConfig
from ..distributed.ep import AUTO_START_FACTOR
from ..distributed.ep_plan import link_capacity
from ..expert_slots import ExpertSlots
from ..model import MoEModel
from ..ops import quant_gemm


def ep_rows(cfg: RunConfig, tokens: int, world: int) -> tuple[int, int] | None:
    """(L, R): local experts and expert GEMM rows per MoE layer under the EP dispatcher; None in one
    process. Every distributed run has it, ep_size 1 included (parallelize.py installs an EP
    dispatcher over a group of one, whose all-to-alls are copies)."""
    p, m = cfg.parallel, cfg.model.moe
    if world == 1:
        return None
    L = ExpertSlots.from_config(m).sharded(p.ep_size).local
    align = math.lcm(m.align, quant_gemm.plan_align(m.precision, 1))  # layers/dispatch.py dispatch_align
    if p.ep_mode == "buffered":
        slots = p.ep_size * link_capacity(p.max_tokens_per_rank or tokens, m.top_k, L, p.ep_size,
                                          buffer_factor(cfg))
    else:
        slots = tokens * m.top_k  # balanced: every rank receives what it sends
    return L, slots + L * (align - 1)


def buffer_factor(cfg: RunConfig) -> float:
    """parallel.ragged_buffer_factor as a number: "auto" sizes the links from the demand seen at the
    overflow checks (train/ep_buffers.py) and starts at AUTO_START_FACTOR, what the first steps hold."""
    f = cfg.parallel.ragged_buffer_factor
    return AUTO_START_FACTOR if f == "auto" else f


def _expected_rank_hits(E: int, K: int, L: int) -> float:
    """Expected number of EP ranks (of E/L) a token's K distinct uniform experts fall on."""
    miss = math.comb(E - L, K) / math.comb(E, K) if E - L >= K else 0.0
    return (E // L) * (1 - miss)


def ep_buffer_bytes(cfg: RunConfig, tokens: int, bf16: bool, world: int, model: MoEModel) -> int:
    """The all-to-all buffers of one MoE layer's forward on one rank (module note): each trip's
    input and output storage, as distributed/comm.py allocates them; 0 in one process (see ep_rows:
    any world > 1 has them, ep_size 1 included). `model`: cfg's model on the meta device."""
    p, m = cfg.parallel, cfg.model.moe
    layers = model.moe_layers()
    if world == 1 or not layers:
        return 0
    slots = layers[0].slots.sharded(p.ep_size)
    P, K, L = p.ep_size, m.top_k, slots.local
    D = layers[0].experts.w_gate_up_EDF.shape[1]  # the rows the experts read (LatentMoE: latent rows)
    # the dispatched rows: the normed residual stream (fp32 even under autocast), or the latent
    # projection's output (a GEMM's: the compute dtype)
    x_es = 4 if layers[0].latent is None else (2 if bf16 else 4)
    y_es = 2 if bf16 else 4  # the experts' output rows: the compute dtype
    counts = 2 * P * (L + 1) * 8
    if p.ep_mode == "buffered":
        C = link_capacity(p.max_tokens_per_rank or tokens, K, L, P, buffer_factor(cfg))
        rows = P * min(C, p.max_tokens_per_rank or tokens) if p.dedup else P * C
        pairs = P * C
    else:
        pairs = tokens * K
        rows = round(tokens * _expected_rank_hits(slots.routed, K, L)) if p.dedup else pairs
    meta_w = 8 if p.dedup else 4  # per pair: fp32 weight (+ int32 row index with de-dup)
    dispatch = (2 * rows + 1) * D * x_es + (2 * pairs + 1) * meta_w
    combine = (2 * rows + (0 if p.dedup else 1)) * D * y_es
    return counts + dispatch + combine
