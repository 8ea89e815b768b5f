"""`dropless bench ep --scenario shifting-skew | replicas | overlap`: buffered-EP buffer policies over a
routing that shifts; hot-expert replication's load balance (`replica_balance`, its own docstring); the
shared experts overlapped with the dispatch all-to-all or not (`_overlap_worker`, its own docstring).

Spawns --nproc gloo processes (CPU, one thread each). Each rank routes --tokens tokens per step, k
distinct of E experts drawn with weight 1/(e+1)^s (Gumbel top-k; s = 0 balanced): --steps steps
balanced, then --steps at Zipf --zipf (1.2), then --steps balanced. Expert e lives on rank e // L, so
the skew loads rank 0's links most.

Byte figures (forward trips: dispatch and combine, summed over ranks and steps; buffered mode with and
without de-dup), per policy: fixed factors 1.0, 1.5, 2.0, the worst case (-1) and "auto"
(train/ep_buffers.py, checks every --check-every steps, grown right after an overflowing step as the
trainer does under retry). Per policy: the bytes the first attempts send, the steps that overflowed and
the pairs that did not fit; what the overflow then costs under each policy: retry (the step again at
worst-case buffers: its bytes added) or spill (the second exact-size exchange: its bytes added). Same
routing for every policy (seeded by step and rank).

Time figure (`spill_vs_retry`): forward + backward of a sharded MoE layer (real grouped experts) on an
overflowing step (Zipf --zipf routing, factor --spill-factor), interleaved: spill (one pass, second
exchange inside), retry (the pass that overflows, the flag read on the host, the pass again with
worst-case buffers), and the same step with links that fit (factor -1) as the floor.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import atomic
from ..config import MoEConfig, ParallelConfig
from ..cpu_alloc import keep_freed_memory
from ..distributed import ep_replicas as replicas
from ..distributed.ep import EPDispatcher
from ..distributed.ep_spill import SpillMeta
from ..distributed.parallelize_ep import shard_moe_layer
from ..expert_slots import ExpertSlots
from ..layers.moe import MoELayer
from ..layers.router import RoutingDecision
from ..train.ep_buffers import AdaptiveBuffers
from .timing import format_table, interleaved

POLICIES: list[tuple[str, float | str]] = [("fixed 1.0", 1.0), ("fixed 1.5", 1.5), ("fixed 2.0", 2.0),
                                           ("worst case", -1), ("auto", "auto")]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=["shifting-skew", "replicas", "overlap"], default=None,
                   help="shifting-skew: buffer policies over balanced -> Zipf -> balanced routing; replicas: "
                        "busiest rank's pairs over the mean with hot-expert replication (instead of the protocol "
                        "bench); overlap: shared experts during the dispatch all-to-all or after it")
    p.add_argument("--shared-width", type=int, default=0, help="overlap: shared expert width (0 = 2 x dim)")
    p.add_argument("--replicas", type=int, default=4, help="replicas: R, copies of the busiest experts")
    p.add_argument("--replica-zipf", type=float, default=1.0, help="replicas: Zipf exponent of the routing")
    p.add_argument("--steps", type=int, default=20, help="shifting-skew: steps per phase")
    p.add_argument("--zipf", type=float, default=1.2, help="shifting-skew: Zipf exponent of the middle phase")
    p.add_argument("--check-every", type=int, default=5, help="shifting-skew: auto's check interval")
    p.add_argument("--spill-factor", type=float, default=1.5,
                   help="shifting-skew: factor of the timed overflowing step")


def zipf_ids(T: int, E: int, K: int, s: float, gen: torch.Generator) -> torch.Tensor:
    """k distinct experts per token, without replacement, weight 1/(e+1)^s: Gumbel top-k."""
    logw = -s * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
    gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=gen).clamp(1e-9, 1 - 1e-9)))
    return (logw + gumbel).topk(K, -1).indices


def _trip_bytes(meta: Any, D: int, es: int) -> torch.Tensor:
    """Dispatch + combine bytes this rank sends (device scalar); a spill meta: both trips."""
    if isinstance(meta, SpillMeta):
        return _trip_bytes(meta.main, D, es) + _trip_bytes(meta.extra, D, es)
    rows_back = meta.rows_recv if meta.src_R is not None else meta.row_n.numel()
    return meta.bytes_sent + rows_back * D * es


def _decision(ids: torch.Tensor, E: int) -> RoutingDecision:
    scores = torch.full((ids.shape[0], E), 1.0 / E)
    return RoutingDecision(ids, scores.gather(1, ids), scores, scores.log())


def _policy_run(rank: int, args: argparse.Namespace, factor: float | str, dedup: bool,
                x_TD: torch.Tensor) -> dict[str, int]:
    T, E, K = args.tokens, args.experts, args.top_k
    D, es = x_TD.shape[1], x_TD.element_size()
    disp = EPDispatcher(E, None, mode="buffered", dedup=dedup, ragged_buffer_factor=factor, max_tokens=T,
                        top_k=K, on_overflow="spill")
    worst = disp.worst_case()
    reduce = lambda t, op: dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)  # noqa: E731
    ctl = AdaptiveBuffers([disp], T, K, reduce, x_TD.device) if factor == "auto" else None
    # first-attempt bytes, spill bytes, retry bytes, overflow steps, overflow pairs, peak link demand
    tot = torch.zeros(6, dtype=torch.int64)
    for step in range(3 * args.steps):
        s = args.zipf if args.steps <= step < 2 * args.steps else 0.0
        gen = torch.Generator().manual_seed(1000 * step + rank)
        dec = _decision(zipf_ids(T, E, K, s, gen), E)
        batch, meta = disp.dispatch(x_TD, dec)
        disp.combine(batch.x_RD, meta)
        spilled = meta.pairs_spilled
        main = meta.main if isinstance(meta, SpillMeta) else meta
        row = torch.stack([_trip_bytes(main, D, es), _trip_bytes(meta, D, es) - _trip_bytes(main, D, es),
                           torch.zeros((), dtype=torch.int64), spilled, spilled, meta.link_demand])
        flag = spilled.clone()
        dist.all_reduce(flag)
        if int(flag):  # retry would rerun the step with worst-case buffers
            b2, m2 = worst.dispatch(x_TD, dec)
            worst.combine(b2.x_RD, m2)
            row[2] = _trip_bytes(m2, D, es)
        dist.all_reduce(row[:5])
        dist.all_reduce(row[5:], op=dist.ReduceOp.MAX)
        row[3] = int(row[3] > 0)
        tot[:5] += row[:5]
        tot[5] = max(int(tot[5]), int(row[5]))
        if ctl is not None:
            ctl.observe([meta])
            if int(flag) or (step + 1) % args.check_every == 0:
                ctl.resize(ctl.reduced_peaks().tolist())
    names = ("bytes_first_attempt", "bytes_spill_extra", "bytes_retry_extra", "overflow_steps",
             "overflow_pairs", "peak_link_demand")
    out = dict(zip(names, tot.tolist()))
    out["link_pairs_end"] = disp.capacity(T, K)
    return out


def _layer_pass(layer: MoELayer, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = layer(x, replay_ids=ids)
    out.y.float().square().mean().backward()
    return out.stats.pairs_dropped


def _timing(rank: int, args: argparse.Namespace) -> dict[str, float]:
    T, E, K, D = args.tokens, args.experts, args.top_k, args.dim
    torch.manual_seed(0)
    ref = MoELayer(D, MoEConfig(num_experts=E, top_k=K, d_expert=max(D // 2, 1)))
    gen = torch.Generator().manual_seed(rank)
    x, ids = torch.randn(T, D, generator=gen), zipf_ids(T, E, K, args.zipf, gen)

    def sharded(factor: float, policy: str) -> MoELayer:
        return shard_moe_layer(copy.deepcopy(ref), None, ParallelConfig(
            ep_size=args.nproc, ep_mode="buffered", ragged_buffer_factor=factor, max_tokens_per_rank=T,
            on_overflow=policy))
    spill, retry, fits = sharded(args.spill_factor, "spill"), sharded(args.spill_factor, "retry"), sharded(-1, "retry")
    worst = retry.dispatcher.worst_case()

    def retry_step() -> None:
        flag = _layer_pass(retry, x, ids).clone()
        dist.all_reduce(flag)
        if int(flag):  # the host read retry pays, then the rerun at worst-case buffers
            retry.zero_grad(set_to_none=True)
            saved, retry.dispatcher = retry.dispatcher, worst
            _layer_pass(retry, x, ids)
            retry.dispatcher = saved

    fns: dict[str, Callable[[], object]] = {"spill": lambda: _layer_pass(spill, x, ids), "retry": retry_step,
                                            "fits": lambda: _layer_pass(fits, x, ids)}
    dropped = _layer_pass(retry, x, ids).clone()
    dist.all_reduce(dropped)
    ms = interleaved(fns, args.repeats, args.warmup, before=dist.barrier)
    slowest = torch.tensor([ms[k] for k in fns], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {**{f"{k}_ms": v for k, v in zip(fns, slowest.tolist())}, "pairs_overflowing": int(dropped)}


def _worker(rank: int, args: argparse.Namespace, store: str, out_path: str) -> None:
    keep_freed_memory()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.nproc)
    x_TD = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    with torch.no_grad():
        policies = {f"{'buffered+dedup' if dedup else 'buffered'} {name}": _policy_run(rank, args, factor, dedup, x_TD)
                    for dedup in (False, True) for name, factor in POLICIES}
    timing = _timing(rank, args)
    if rank == 0:
        with atomic.atomic_write(out_path, "w") as fh:
            json.dump({"policies": policies, "spill_vs_retry": timing}, fh)
    dist.destroy_process_group()


def _overlap_worker(rank: int, args: argparse.Namespace, store: str, out_path: str) -> None:
    """A sharded MoE layer with one shared expert (width --shared-width), balanced random routing,
    exact mode and buffered (factor --factor), de-dup on: forward alone (no_grad) and forward +
    backward, `parallel.overlap_shared` off and on, interleaved in one run; the slowest rank's median."""
    keep_freed_memory()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.nproc)
    T, E, K, D = args.tokens, args.experts, args.top_k, args.dim
    torch.manual_seed(0)
    ref = MoELayer(D, MoEConfig(num_experts=E, top_k=K, d_expert=max(D // 2, 1), n_shared_experts=1,
                                d_shared=args.shared_width or 2 * D))
    gen = torch.Generator().manual_seed(rank)
    x, ids = torch.randn(T, D, generator=gen), zipf_ids(T, E, K, 0.0, gen)
    fns: dict[str, Callable[[], object]] = {}
    for mode in ("exact", "buffered"):
        for overlap in (False, True):
            layer = shard_moe_layer(copy.deepcopy(ref), None, ParallelConfig(
                ep_size=args.nproc, ep_mode=mode, ragged_buffer_factor=args.factor, max_tokens_per_rank=T,
                overlap_shared=overlap))
            tag = f"{mode} {'overlapped' if overlap else 'plain'}"
            fns[f"{tag}/fwd"] = torch.no_grad()(lambda layer=layer: layer(x, replay_ids=ids))
            fns[f"{tag}/fwd_bwd"] = lambda layer=layer: _layer_pass(layer, x, ids)
    ms = interleaved(fns, args.repeats, args.warmup, before=dist.barrier)
    slowest = torch.tensor([ms[k] for k in fns], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        with atomic.atomic_write(out_path, "w") as fh:
            json.dump(dict(zip(fns, slowest.tolist())), fh)
    dist.destroy_process_group()


def _overlap_rows(ms: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for mode in ("exact", "buffered"):
        for part in ("fwd", "fwd_bwd"):
            a, b = ms[f"{mode} plain/{part}"], ms[f"{mode} overlapped/{part}"]
            rows.append(dict(mode=mode, part=part, plain_ms=round(a, 2), overlapped_ms=round(b, 2),
                             overlapped_over_plain=round(b / a, 3)))
    return rows


def replica_balance(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Busiest rank's pairs over the mean, unreplicated and with R copies (one spare slot per rank,
    or more when R > P), per expert numbering. The placement comes from step 0's global counts and
    is measured on the next --steps steps (fresh routing from the same distribution), through
    `virtual_ids`, the routing the replicating dispatcher sends by. In one process: no collective
    is needed to count where pairs go."""
    P, E, K, T, R = args.nproc, args.experts, args.top_k, args.tokens, args.replicas
    L, S = E // P, max(1, -(-R // (P - 1)))
    rows = []
    for numbering in ("hot experts first", "random"):
        gen = torch.Generator().manual_seed(0)
        perm = torch.arange(E) if numbering == "hot experts first" else torch.randperm(E, generator=gen)

        def step_ids(step: int) -> list[torch.Tensor]:
            return [perm[zipf_ids(T, E, K, args.replica_zipf, torch.Generator().manual_seed(1000 * step + r))]
                    for r in range(P)]
        counts = torch.bincount(torch.cat(step_ids(0)).reshape(-1), minlength=E)
        reps = replicas.plan_replicas(counts.tolist(), R, P, S)
        tables = replicas.slot_tables(reps, ExpertSlots(E, ep_size=P, spare=S), torch.device("cpu"))
        plain, replicated = torch.zeros(P, dtype=torch.float64), torch.zeros(P, dtype=torch.float64)
        worst_plain, worst_rep = 0.0, 0.0
        for step in range(1, args.steps + 1):
            ids = step_ids(step)
            a = torch.bincount(torch.cat(ids).reshape(-1) // L, minlength=P).double()
            b = torch.bincount(torch.cat([replicas.virtual_ids(i, tables) for i in ids]).reshape(-1) // (L + S),
                               minlength=P).double()
            worst_plain = max(worst_plain, float(a.max() / a.mean()))
            worst_rep = max(worst_rep, float(b.max() / b.mean()))
            plain, replicated = plain + a, replicated + b
        rows.append(dict(numbering=numbering, replicas=len(reps), spare_slots=S,
                         busiest_over_mean_plain=round(float(plain.max() / plain.mean()), 3),
                         busiest_over_mean_replicated=round(float(replicated.max() / replicated.mean()), 3),
                         worst_step_plain=round(worst_plain, 3), worst_step_replicated=round(worst_rep, 3)))
    return rows


def main(args: argparse.Namespace) -> int:
    if args.scenario == "replicas":
        rows = replica_balance(args)
        config = {k: v for k, v in vars(args).items() if k in ("nproc", "tokens", "experts", "top_k", "replicas",
                                                               "replica_zipf", "steps")}
        print(f"dropless bench ep --scenario replicas: {config}")
        print(format_table(rows, list(rows[0])))
        if args.json:
            with atomic.atomic_write(args.json, "w") as fh:
                json.dump({"config": config, "rows": rows}, fh, indent=2)
        return 0
    worker = _overlap_worker if args.scenario == "overlap" else _worker
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.start_processes(worker, args=(args, os.path.join(tmp, "store"), out_path), nprocs=args.nproc,
                           start_method="spawn")
        with open(out_path) as fh:
            result = json.load(fh)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    if args.scenario == "overlap":
        rows = _overlap_rows(result)
        print(f"dropless bench ep --scenario overlap: {config}")
        print(format_table(rows, list(rows[0])))
        if args.json:
            with atomic.atomic_write(args.json, "w") as fh:
                json.dump({"config": config, "rows": rows, "ms": result}, fh, indent=2)
        return 0
    balanced = args.tokens * args.top_k / args.nproc
    rows = [dict(policy=name, **v, factor_end=round(v["link_pairs_end"] / balanced, 3),
                 bytes_with_retry=v["bytes_first_attempt"] + v["bytes_retry_extra"],
                 bytes_with_spill=v["bytes_first_attempt"] + v["bytes_spill_extra"])
            for name, v in result["policies"].items()]
    print(f"dropless bench ep --scenario shifting-skew: {config}")
    print(format_table(rows, ["policy", "bytes_first_attempt", "overflow_steps", "overflow_pairs",
                              "bytes_with_retry", "bytes_with_spill", "peak_link_demand", "factor_end"]))
    t = result["spill_vs_retry"]
    print(f"overflowing step (Zipf {args.zipf}, factor {args.spill_factor}, {t['pairs_overflowing']} pairs over), "
          f"MoE layer forward + backward: spill {t['spill_ms']:.2f} ms, retry {t['retry_ms']:.2f} ms, "
          f"links that fit {t['fits_ms']:.2f} ms")
    if args.json:
        with atomic.atomic_write(args.json, "w") as fh:
            json.dump({"config": config, **result}, fh, indent=2)
    return 0
