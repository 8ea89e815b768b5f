"""`dropless bench a2a`: all-to-all bandwidth against an all-reduce of the same bytes, per message size.

    dropless bench a2a --nproc N [--sizes 64K 1M 16M] [--device auto|cpu|cuda] [--repeats R] [--json FILE]

Spawns N processes on one group (gloo on the CPU, one thread each; NCCL with one GPU per process on
CUDA) and times, interleaved and after a barrier (timing.py), for every size S (bytes each rank
sends, fp32 elements split evenly over the N ranks): `all_to_all_single` of S bytes and `all_reduce`
of the same S-byte tensor on the same group. Reported per size: the slowest rank's median ms of
each, their ratio, and the bandwidths in the nccl-tests convention: algbw = S / time, busbw = algbw x
(N-1)/N for the all-to-all (each rank moves (N-1)/N of its buffer over links) and algbw x 2(N-1)/N
for the all-reduce (a ring's reduce-scatter plus all-gather). Equal busbw means the all-to-all uses
the links as well as the all-reduce does; an all-to-all far below the all-reduce on the same group
is the failure the trainer's all-to-all alarm watches for (docs/ep_health.md, "All-to-all health").

`--overlap D` adds, per size, what overlapping a shared expert with the exchange would save: a
shared-expert MLP (D -> 4D -> D, SiLU, fp32) over the S/(4D) rows that the all-to-all moves, timed
alone, after a blocking all-to-all (sequential), and while an `async_op=True` all-to-all is in flight
(issue, compute, wait). `hidden` = (sequential - overlapped) / min(all-to-all, MLP): 1 when the
shorter of the two hides entirely behind the other, 0 when nothing overlaps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from .. import atomic
from ..cpu_alloc import keep_freed_memory
from .timing import format_table, interleaved, sync

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DEFAULT_SIZES = ["64K", "1M", "16M"]


def parse_size(text: str) -> int:
    """'64K' -> 65536 (binary units K, M, G; a plain number is bytes)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    number = t[:-1] if unit else t
    if not number.isdigit() or int(number) <= 0:
        raise ValueError(f"--sizes {text!r}: must be a positive byte count such as 65536, 64K or 16M")
    return int(number) * _UNITS[unit]


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[int]]:
    p = argparse.ArgumentParser(prog="dropless bench a2a", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes in the group")
    p.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES,
                   help="bytes each rank sends per call (K, M, G binary units)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA (NCCL) when there are --nproc GPUs, else the CPU (gloo)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--overlap", type=int, default=0, metavar="D",
                   help="also time a width-D shared-expert MLP with and without overlap (0: off)")
    p.add_argument("--json", type=str, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.overlap < 0:
        raise ValueError(f"--overlap {args.overlap}: must be a width >= 1 (0: off)")
    if args.nproc < 2:
        raise ValueError(f"--nproc {args.nproc}: an all-to-all needs at least 2 processes")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"--repeats {args.repeats} / --warmup {args.warmup}: need repeats >= 1, warmup >= 0")
    sizes = [parse_size(s) for s in args.sizes]
    for text, size in zip(args.sizes, sizes):
        if size % (4 * args.nproc):
            raise ValueError(f"--sizes {text}: {size} bytes do not split into fp32 blocks over "
                             f"{args.nproc} ranks (need a multiple of {4 * args.nproc})")
        if args.overlap and size < 4 * args.overlap:
            raise ValueError(f"--sizes {text}: below one row of --overlap {args.overlap} fp32 values")
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise ValueError(f"--device cuda: {torch.cuda.device_count()} GPUs for --nproc {args.nproc}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.device_count() >= args.nproc else "cpu"
    return args, sizes


def _worker(rank: int, args: argparse.Namespace, sizes: list[int], store: str, out_path: str) -> None:
    keep_freed_memory()  # spawned: the parent's mallopt does not carry over
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.nproc)
    fns = {}
    for size in sizes:
        send = torch.randn(size // 4, device=dev)
        recv = torch.empty_like(send)
        fns[f"{size}/a2a"] = lambda s=send, r=recv: dist.all_to_all_single(r, s)
        fns[f"{size}/all_reduce"] = lambda s=send: dist.all_reduce(s)  # sums in place: timing only
        if args.overlap:
            D = args.overlap
            x = torch.randn(size // (4 * D), D, device=dev)
            w1, w2 = torch.randn(4 * D, D, device=dev) / D ** 0.5, torch.randn(D, 4 * D, device=dev) / (2 * D ** 0.5)
            mlp = lambda x=x, w1=w1, w2=w2: F.linear(F.silu(F.linear(x, w1)), w2)  # noqa: E731
            fns[f"{size}/mlp"] = mlp

            def sequential(s=send, r=recv, mlp=mlp) -> None:
                dist.all_to_all_single(r, s)
                mlp()

            def overlapped(s=send, r=recv, mlp=mlp) -> None:
                work = dist.all_to_all_single(r, s, async_op=True)
                mlp()
                work.wait()
            fns[f"{size}/sequential"], fns[f"{size}/overlapped"] = sequential, overlapped

    def barrier() -> None:
        sync(dev)
        dist.barrier()

    ms = interleaved(fns, args.repeats, args.warmup, device=dev, before=barrier)
    slowest = torch.tensor([ms[k] for k in fns], dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(dict(zip(fns, slowest.tolist())), fh)
    dist.destroy_process_group()


def rows_from_times(ms: dict[str, float], sizes: list[int], nproc: int) -> list[dict]:
    """One row per size: ms, algbw and busbw (GB/s, 1e9 bytes) of both collectives, and their ratios."""
    n = nproc
    rows = []
    for size in sizes:
        a2a, ar = ms[f"{size}/a2a"], ms[f"{size}/all_reduce"]
        alg_a2a, alg_ar = size / a2a / 1e6, size / ar / 1e6  # bytes per ms -> GB/s
        rows.append(dict(bytes=size, a2a_ms=a2a, all_reduce_ms=ar, a2a_over_all_reduce_time=a2a / ar,
                         a2a_algbw_gbs=alg_a2a, a2a_busbw_gbs=alg_a2a * (n - 1) / n,
                         all_reduce_algbw_gbs=alg_ar, all_reduce_busbw_gbs=alg_ar * 2 * (n - 1) / n,
                         busbw_ratio=(alg_a2a * (n - 1) / n) / (alg_ar * 2 * (n - 1) / n)))
        if f"{size}/mlp" in ms:
            mlp, seq, ovl = ms[f"{size}/mlp"], ms[f"{size}/sequential"], ms[f"{size}/overlapped"]
            rows[-1].update(mlp_ms=mlp, sequential_ms=seq, overlapped_ms=ovl, hidden=(seq - ovl) / min(a2a, mlp))
    return rows


def main(argv: list[str] | None = None) -> int:
    try:
        args, sizes = _parse(list(sys.argv[1:] if argv is None else argv))
    except ValueError as err:
        print(f"dropless bench a2a: error: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(args, sizes, os.path.join(tmp, "store"), out_path),
                           nprocs=args.nproc, start_method="spawn")
        with open(out_path) as fh:
            ms = json.load(fh)
    backend = "nccl" if args.device == "cuda" else "gloo"
    config = {k: v for k, v in vars(args).items() if k != "json"} | {"backend": backend, "bytes": sizes}
    rows = rows_from_times(ms, sizes, args.nproc)
    print(f"dropless bench a2a: {config}")
    print(format_table(rows, ["bytes", "a2a_ms", "all_reduce_ms", "a2a_over_all_reduce_time", "a2a_busbw_gbs",
                              "all_reduce_busbw_gbs", "busbw_ratio"]))
    if args.overlap:
        print(f"shared-expert MLP (width {args.overlap}) over the rows the all-to-all moves:")
        print(format_table(rows, ["bytes", "a2a_ms", "mlp_ms", "sequential_ms", "overlapped_ms", "hidden"]))
    if args.json:  # atomic: no half-written file on failure
        atomic.write_text(args.json, json.dumps({"config": config, "sizes": rows}, indent=2))
    return 0
