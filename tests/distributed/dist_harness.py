"""Run a function on a small gloo world of spawned processes (CPU), for the distributed tests.

Rendezvous is a FileStore in the test's tmp_path: no TCP port to pick, so no race with other test runs
on the machine. Each worker runs single-threaded: the CI machine has 2 cores for up to 4 workers.
A worker that finished ends as the CLI's workers do (dropless.distributed.worker_exit: destroy the
group, flush, os._exit), and faulthandler prints every thread's stack if one dies of a signal.
"""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dropless.distributed.worker_exit import end_worker


def _entry(rank: int, fn: Callable[..., None], world: int, store: str, args: tuple[Any, ...]) -> None:
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    end_worker()


def run_world(fn: Callable[..., None], world: int, tmp_path: Path, *args: Any) -> None:
    """Run fn(rank, world, *args) on `world` gloo processes; a worker's exception fails the caller."""
    store = str(tmp_path / f"store_{world}")
    if os.path.exists(store):
        os.remove(store)
    mp.start_processes(_entry, args=(fn, world, store, args), nprocs=world, start_method="spawn")
