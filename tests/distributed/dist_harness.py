"""Run a function on a small gloo world of spawned processes (CPU), for the distributed tests.

Rendezvous is a FileStore in the test's tmp_path: no TCP port to pick, so no race with other test runs
on the machine. Each worker runs single-threaded: the CI machine has 2 cores for up to 4 workers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., None], world: int, store: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_world(fn: Callable[..., None], world: int, tmp_path: Path, *args: Any) -> None:
    """Run fn(rank, world, *args) on `world` gloo processes; a worker's exception fails the caller."""
    store = str(tmp_path / f"store_{world}")
    if os.path.exists(store):
        os.remove(store)
    mp.start_processes(_entry, args=(fn, world, store, args), nprocs=world, start_method="spawn")
