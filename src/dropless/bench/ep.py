"""`dropless bench ep`: the EP dispatcher against the raw collectives it is built on.

Spawns --nproc gloo processes (CPU; one thread each) that route T tokens each, top-k of E experts
from random logits (balanced in expectation), and time, interleaved in one run:
- dispatch + combine of the EPDispatcher (identity experts: the rows come straight back; the routing
  weights, which the experts apply, are left out), per mode (exact, buffered), de-dup on and off;
- the raw `all_to_all_single` calls moving the same bytes with the same splits (rows out, the
  pair metadata out (routing weights; with de-dup also row indices), rows back) into preallocated
  buffers: the floor the dispatcher can approach.
Reported per variant: median ms (the slowest rank's median), their ratio, and the bytes the dispatch
trip sends summed over ranks, with and without de-dup. Targets (issue): de-dup saves about half the
bytes at E=64, k=8, EP=4; dispatch + combine within 1.3x of the raw collectives.

Recompute (`model.recompute` "moe" or "layer" under EP, layers/recompute.py) repeats the all-to-alls
in the backward. Per variant, also timed: forward + backward of dispatch -> weighted identity experts
(each row times its routing weight, so the weights' gradient travels back as in the model) ->
combine, plain and inside a non-reentrant checkpoint; and counted, summed over ranks: the bytes of
the forward's trips (count exchange, dispatch, combine), of the backward's (the reverse dispatch and
combine trips; the count exchange has none), and the extra bytes a recompute sends (the forward's
trips again). Rows travel in x's dtype (the identity experts return it).

`--payloads native,mxfp8` runs every variant with each `parallel.dispatch_dtype`: the dispatch trip's
rows then travel encoded (the raw floor moves the same uint8 rows), and `bytes_vs_first_payload` is
its bytes against the same variant with the first payload. `--dispatches all_to_all,ring` adds the
ring dispatch (`ring-exact`, `ring-buffered`: all-gather out, reduce-scatter back; its raw floor is
those collectives); `fwd_bytes` then compares the two protocols' forward trips.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

from .. import atomic
from ..cpu_alloc import keep_freed_memory
from ..distributed.ep import EPDispatcher, link_capacity
from ..distributed.ep_exchange import EPMeta
from ..distributed.ep_hier import HierEPDispatcher, HierMeta
from ..distributed.mesh import ep_hier_groups
from ..distributed.ep_ring import RingMeta
from ..layers.router import RoutingDecision
from ..ops import payload
from . import ep_scenarios
from .timing import format_table, interleaved

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dropless bench ep", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="EP size (gloo processes)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--dim", type=int, default=1024, help="model width d")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--factor", type=float, default=2.0, help="ragged_buffer_factor for buffered mode")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", type=str, default=None, help="write the results here")
    p.add_argument("--payloads", type=str, default="native",
                   help="comma-separated parallel.dispatch_dtype values to compare (native, bf16, mxfp8, "
                        "fp8_blockwise); each mode runs with each, and bytes are also given against the first")
    p.add_argument("--dispatches", type=str, default="all_to_all",
                   help="comma-separated parallel.ep_dispatch values to compare (all_to_all, ring)")
    p.add_argument("--node-size", type=int, default=0,
                   help="> 0: the ranks as nodes of this many; adds the two-level dispatch (node-exact, "
                        "node-buffered) and counts every variant's dispatch bytes to other nodes")
    ep_scenarios.add_args(p)
    return p.parse_args(argv)


def _raw_ring_fns(x_TD: torch.Tensor, ids_TK: torch.Tensor, disp: EPDispatcher
                  ) -> tuple[Callable[[], None], Callable[[], None]]:
    """The ring's collectives alone, into preallocated buffers: the rows (as the payload encodes
    them), the weights and ids gathered, the results reduce-scattered (no count exchange)."""
    P, (T, K), D = disp.ep_size, ids_TK.shape, x_TD.shape[1]
    wire = payload.wire_dtype(disp.dispatch_dtype, x_TD.dtype)
    W = payload.row_bytes(disp.dispatch_dtype, D, x_TD.dtype) // wire.itemsize
    rows, rows_all = torch.zeros(T, W, dtype=wire), torch.zeros(P * T, W, dtype=wire)
    slots, slots_all = torch.zeros(T, 2 * K, dtype=torch.int32), torch.zeros(P * T, 2 * K, dtype=torch.int32)
    y_all, y = x_TD.new_zeros(P * T, D), x_TD.new_zeros(T, D)

    def data() -> None:
        dist.all_gather_single(rows_all, rows, group=disp.group)
        dist.all_gather_single(slots_all, slots, group=disp.group)
        dist.reduce_scatter_single(y, y_all, group=disp.group)
    return data, data


def _raw_fns(x_TD: torch.Tensor, ids_TK: torch.Tensor, disp: EPDispatcher, factor: float
             ) -> tuple[Callable[[], None], Callable[[], None]]:
    """The dispatcher's collectives with precomputed splits and buffers and no local work between
    them: (all of them: the count exchange with its host read, then the data; the data only)."""
    P, L, T, K, D = disp.ep_size, disp.num_local, *ids_TK.shape, x_TD.shape[1]
    g = disp.group
    # the rows as the payload puts them on the wire (uint8 codes and scales, bf16, or x itself)
    wire = payload.wire_dtype(disp.dispatch_dtype, x_TD.dtype)
    W = payload.row_bytes(disp.dispatch_dtype, D, x_TD.dtype) // wire.itemsize
    hits_TP = torch.zeros(T, P, dtype=torch.int64).index_put_(
        (torch.arange(T).repeat_interleave(K), (ids_TK // L).reshape(-1)), torch.ones(T * K, dtype=torch.int64),
        accumulate=True)
    send = torch.stack([(hits_TP > 0).sum(0), hits_TP.sum(0)], 1)  # rows (de-dup), pairs per destination
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=g)
    rows_s, rows_r = send[:, int(not disp.dedup)].tolist(), recv[:, int(not disp.dedup)].tolist()
    pairs_s, pairs_r = send[:, 1].tolist(), recv[:, 1].tolist()
    if disp.mode == "buffered":
        C = link_capacity(T, K, L, P, factor)
        rows_s = rows_r = [min(C, T) if disp.dedup else C] * P
        pairs_s = pairs_r = [C] * P
    meta_width = 2 if disp.dedup else 1  # (weight, row index) per pair, or the weight alone
    bufs = [torch.zeros(sum(rows_s), W, dtype=wire), torch.zeros(sum(rows_r), W, dtype=wire),
            torch.empty(sum(pairs_s), meta_width), torch.empty(sum(pairs_r), meta_width),
            x_TD.new_empty(sum(rows_s), D), x_TD.new_empty(sum(rows_r), D)]
    counts = [torch.zeros(P * (L + 1), dtype=torch.int64), torch.empty(P * (L + 1), dtype=torch.int64)]

    def data() -> None:
        dist.all_to_all_single(bufs[1], bufs[0], rows_r, rows_s, group=g)
        dist.all_to_all_single(bufs[3], bufs[2], pairs_r, pairs_s, group=g)
        dist.all_to_all_single(bufs[4], bufs[5], rows_s, rows_r, group=g)  # combine: the rows' dtype

    def everything() -> None:
        # the dispatcher's first step: [pairs per local expert, rows] to every rank, fixed size
        dist.all_to_all_single(counts[1], counts[0], group=g)
        if disp.mode == "exact":
            counts[1].tolist()  # exact mode reads the split sizes on the host
        data()
    return everything, data


def trip_bytes(meta: EPMeta, x_TD: torch.Tensor, ep_size: int, num_local: int) -> dict[str, torch.Tensor]:
    """Bytes this rank sends (to every rank, itself included) per trip of one dispatch + combine, as
    int64 device scalars: the count exchange (P rows of L + 1 int64), the dispatch trip (rows and pair
    metadata: `meta.bytes_sent`), the combine trip (the rows going back, in x's dtype). The backward
    sends the combine trip back reversed and the dispatch trip's gradients (`dispatch_back`: bf16 rows
    under a payload); a recompute repeats the forward's three."""
    if isinstance(meta, HierMeta):  # the node's trips (a flat group of G ranks), then the rail's
        G = meta.node_size
        inner = trip_bytes(meta.inner, x_TD, G, meta.inner.num_local)
        rail_back = x_TD.new_full((), meta.seg_S.numel() * x_TD.shape[1] * x_TD.element_size(), dtype=torch.int64)
        # exact: the rail's count exchange (an int64 per node); buffered: none (fixed blocks)
        rail_counts = x_TD.new_full((), 0 if meta.splits is None else ep_size // G * 8, dtype=torch.int64)
        return {"counts": inner["counts"] + rail_counts, "dispatch": meta.bytes_sent,
                "combine": inner["combine"] + rail_back, "dispatch_back": meta.bytes_back}
    if isinstance(meta, RingMeta):  # no count exchange; P shares of every rank's block come back
        combine = x_TD.new_full((), ep_size * meta.block * x_TD.shape[1] * x_TD.element_size(), dtype=torch.int64)
        return {"counts": torch.zeros_like(combine), "dispatch": meta.bytes_sent, "combine": combine,
                "dispatch_back": meta.bytes_back}
    rows_back = meta.rows_recv if meta.src_R is not None else meta.row_n.numel()
    counts = x_TD.new_full((), ep_size * (num_local + 1) * 8, dtype=torch.int64)
    combine = x_TD.new_full((), rows_back * x_TD.shape[1] * x_TD.element_size(), dtype=torch.int64)
    return {"counts": counts, "dispatch": meta.bytes_sent, "combine": combine, "dispatch_back": meta.bytes_back}


def inter_node_bytes(meta: object, ids_TK: torch.Tensor, disp: EPDispatcher, G: int, x_TD: torch.Tensor
                     ) -> torch.Tensor:
    """The dispatch trip's bytes from this rank to ranks on other nodes (nodes of G consecutive ranks):
    the two-level dispatch counts its rail trip's (buffered: its whole blocks to other nodes); a
    buffered or ring trip sends equal blocks to every rank; an exact all-to-all sends the rows
    (de-dup: one per (token, rank)) and pair metadata its routing puts on the other nodes' ranks."""
    if isinstance(meta, HierMeta):
        return meta.bytes_inter_node
    P = disp.ep_size
    if isinstance(meta, RingMeta) or disp.mode == "buffered":
        return meta.bytes_sent * (P - G) // P
    rank_TK = ids_TK // disp.num_local
    away_TK = rank_TK // G != disp.rank // G
    rb = payload.row_bytes(disp.dispatch_dtype, x_TD.shape[1], x_TD.dtype)
    if not disp.dedup:
        return away_TK.sum() * (rb + 4)
    hit_TP = torch.zeros(ids_TK.shape[0], P, dtype=torch.bool).scatter_(1, rank_TK, True)
    away_P = torch.arange(P) // G != disp.rank // G
    return (hit_TP & away_P).sum() * rb + away_TK.sum() * 8


def fwd_bwd_fn(disp: EPDispatcher, x_TD: torch.Tensor, logits_TE: torch.Tensor, ids_TK: torch.Tensor,
               recompute: bool) -> Callable[[], None]:
    """Forward and backward of router weights -> dispatch -> weighted identity experts -> combine, the
    MoE part of it inside a non-reentrant checkpoint when `recompute` (what model.recompute "moe" does)."""
    def region(x: torch.Tensor, lg: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(lg, -1)
        batch, meta = disp.dispatch(x, RoutingDecision(ids_TK, scores.gather(1, ids_TK), scores, lg))
        return disp.combine(batch.x_RD * batch.weights_R[:, None].to(x.dtype), meta)

    def run() -> None:
        with torch.enable_grad():
            x, lg = x_TD.detach().requires_grad_(True), logits_TE.detach().requires_grad_(True)
            y = checkpoint(region, x, lg, use_reentrant=False) if recompute else region(x, lg)
            y.float().sum().backward()
    return run


def _worker(rank: int, args: argparse.Namespace, store: str, out_path: str) -> None:
    keep_freed_memory()  # spawned: the parent's mallopt does not carry over (its environment does)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.nproc)
    gen = torch.Generator().manual_seed(rank)
    T, E, K, D = args.tokens, args.experts, args.top_k, args.dim
    x_TD = torch.randn(T, D, generator=gen).to(DTYPES[args.dtype])
    logits_TE = torch.randn(T, E, generator=gen)
    scores_TE = torch.softmax(logits_TE, -1)
    weights_TK, ids_TK = scores_TE.topk(K, -1)
    decision = RoutingDecision(ids_TK, weights_TK, scores_TE, logits_TE)
    fns: dict[str, Callable[[], object]] = {}
    stats: dict[str, dict[str, int]] = {}
    G = args.node_size
    hier = ep_hier_groups(args.nproc, G, "cpu") if G else None
    hows = args.dispatches.split(",") + (["node"] if G else [])
    for how, mode, dedup, pl in ((h, m, d, pl) for h in hows for m in ("exact", "buffered")
                                 for d in (True, False) for pl in args.payloads.split(",")):
        if how == "ring" and not dedup:
            continue  # the ring has no de-dup switch
        name = {"all_to_all": f"{mode}{'+dedup' if dedup else ''}", "ring": f"ring-{mode}",
                "node": f"node-{mode}{'+dedup' if dedup else ''}"}[how] + (f":{pl}" if pl != "native" else "")
        if how == "node":
            disp = HierEPDispatcher(E, None, mode=mode, dedup=dedup, ragged_buffer_factor=args.factor, max_tokens=T,
                                    top_k=K, dispatch_dtype=pl, node_group=hier[0], rail_group=hier[1], node_size=G)
        else:
            disp = EPDispatcher(E, None, mode=mode, dedup=dedup, ragged_buffer_factor=args.factor,
                                max_tokens=T, dispatch_dtype=pl, ep_dispatch=how)

        def ep_fn(disp: EPDispatcher = disp) -> object:
            batch, meta = disp.dispatch(x_TD, decision)
            return disp.combine(batch.x_RD, meta), meta

        with torch.no_grad():
            _, meta = ep_fn()
        trips = trip_bytes(meta, x_TD, disp.ep_size, disp.num_local)
        fwd = trips["counts"] + trips["dispatch"] + trips["combine"]
        away = inter_node_bytes(meta, ids_TK, disp, G, x_TD) if G else torch.zeros((), dtype=torch.int64)
        totals = torch.stack([meta.bytes_sent, meta.bytes_sent_without_dedup, meta.overflow, fwd,
                              trips["dispatch_back"] + trips["combine"], fwd, away])
        dist.all_reduce(totals, group=None)
        stats[name] = dict(zip(("bytes_sent", "bytes_sent_without_dedup", "overflow", "fwd_bytes",
                                "bwd_bytes", "recompute_extra_bytes", "inter_node_bytes"), totals.tolist()))
        fns[f"{name}/ep"] = ep_fn
        fns[f"{name}/fwd_bwd"] = fwd_bwd_fn(disp, x_TD, logits_TE, ids_TK, recompute=False)
        fns[f"{name}/recompute"] = fwd_bwd_fn(disp, x_TD, logits_TE, ids_TK, recompute=True)
        if how == "ring":
            fns[f"{name}/raw"], fns[f"{name}/raw_data"] = _raw_ring_fns(x_TD, ids_TK, disp)
        elif how == "node":  # its floor is the flat exchange's collectives over the node and the rail
            fns[f"{name}/raw"] = fns[f"{name}/raw_data"] = _raw_fns(x_TD, ids_TK, disp, args.factor)[1]
        else:
            fns[f"{name}/raw"], fns[f"{name}/raw_data"] = _raw_fns(x_TD, ids_TK, disp, args.factor)
    with torch.no_grad():
        ms = interleaved(fns, args.repeats, args.warmup, before=dist.barrier)
    slowest = torch.tensor([ms[k] for k in fns], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    ms = dict(zip(fns, slowest.tolist()))
    if rank == 0:
        result = {name: dict(dispatch_combine_ms=ms[f"{name}/ep"], raw_all_to_all_ms=ms[f"{name}/raw"],
                             raw_data_all_to_all_ms=ms[f"{name}/raw_data"],
                             ratio=ms[f"{name}/ep"] / ms[f"{name}/raw"],
                             ratio_data_only=ms[f"{name}/ep"] / ms[f"{name}/raw_data"],
                             fwd_bwd_ms=ms[f"{name}/fwd_bwd"], recompute_fwd_bwd_ms=ms[f"{name}/recompute"],
                             recompute_time_ratio=ms[f"{name}/recompute"] / ms[f"{name}/fwd_bwd"], **stats[name])
                  for name in stats}
        with atomic.atomic_write(out_path, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    for pl in args.payloads.split(","):
        payload.check(pl)
    for how in args.dispatches.split(","):
        if how not in ("all_to_all", "ring"):
            print(f"--dispatches: {how!r} is not all_to_all or ring", file=sys.stderr)
            return 2
    if args.experts % args.nproc:
        print(f"--experts={args.experts} is not divisible by --nproc={args.nproc}", file=sys.stderr)
        return 2
    if args.scenario:
        return ep_scenarios.main(args)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(args, os.path.join(tmp, "store"), out_path), nprocs=args.nproc,
                           start_method="spawn")
        with open(out_path) as fh:
            modes = json.load(fh)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    first = args.payloads.split(",")[0]

    def vs_first(name: str) -> float:  # dispatch bytes against the same variant with the first payload
        base = name.split(":")[0] + (f":{first}" if first != "native" else "")
        return modes[name]["bytes_sent"] / modes[base]["bytes_sent"]
    for name, v in modes.items():
        v["bytes_vs_first_payload"] = vs_first(name)
    rows = [dict(variant=name, **v, dedup_saving=1 - v["bytes_sent"] / v["bytes_sent_without_dedup"])
            for name, v in modes.items()]
    print(f"dropless bench ep: {config}")
    if args.node_size:
        print(f"dispatch bytes to other nodes (nodes of {args.node_size} ranks):")
        print(format_table(rows, ["variant", "bytes_sent", "inter_node_bytes"]))
    print(format_table(rows, ["variant", "dispatch_combine_ms", "raw_all_to_all_ms", "ratio",
                              "raw_data_all_to_all_ms", "ratio_data_only", "bytes_sent",
                              "bytes_sent_without_dedup", "dedup_saving", "bytes_vs_first_payload", "overflow"]))
    print("recompute of the MoE layer (model.recompute moe/layer) repeats the forward's trips:")
    print(format_table(rows, ["variant", "fwd_bwd_ms", "recompute_fwd_bwd_ms", "recompute_time_ratio",
                              "fwd_bytes", "bwd_bytes", "recompute_extra_bytes"]))
    if args.json:
        with atomic.atomic_write(args.json, "w") as fh:
            json.dump({"config": config, "modes": modes}, fh, indent=2)
    return 0
