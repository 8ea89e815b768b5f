"""Timing helpers for benchmarks: interleaved repeats, medians, a printed table.

Variants are timed in turns (rep 1 of every variant, then rep 2, ...) so that noise from a shared,
busy machine falls on all of them alike; the reported figure is the median over repeats.
On CUDA, kernels run asynchronously: each timed call is bracketed by a device synchronisation, so
the wall time covers the work queued by the call and nothing queued before it.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def sync(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device | str = "cpu") -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int,
                device: torch.device | str = "cpu", progress: Callable[[int], None] | None = None,
                before: Callable[[], object] | None = None) -> dict[str, float]:
    """Median milliseconds per named function, timed round-robin. `before` runs untimed ahead of
    every timed call (the EP bench passes a barrier, so that every rank starts each call together
    and no call is charged for the previous one's stragglers)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(repeats):
        for name, fn in fns.items():
            if before is not None:
                before()
            samples[name].append(time_once(fn, device))
        if progress is not None:
            progress(rep)
    return {name: statistics.median(v) for name, v in samples.items()}


def format_table(rows: list[dict], columns: list[str]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return "-" if v is None else str(v)

    table = [columns] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths)))
             for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cpu_flags() -> str:
    """This CPU's AMX and AVX-512-BF16 flags (what decides bf16 speed on a CPU), quoted beside every
    CPU speed figure."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    return " ".join(sorted(set(re.findall(r"\b(amx_\w+|avx512_bf16)\b", text)))) or "none of amx*, avx512_bf16"
