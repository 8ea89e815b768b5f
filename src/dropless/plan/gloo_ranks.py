"""Run one measurement on every rank of a gloo world of spawned CPU processes and collect what each
rank returns: the validation's harness (validate.py, validate_pipeline.py)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..distributed.worker_exit import end_worker


def _worker(rank: int, world: int, store: str, fn: Callable[..., dict[str, Any]], args: tuple,
            outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(fn(*args)))
    except BaseException:
        dist.destroy_process_group()
        raise
    end_worker()  # worker_exit.py: the trainer's meshes outlive destroy_process_group()


def on_ranks(world: int, fn: Callable[..., dict[str, Any]], *args: Any) -> list[dict[str, Any]]:
    """`fn(*args)` on each of `world` spawned gloo processes (one thread each); its results by rank.
    `fn` must be importable by name (spawn pickles it)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), fn, args, tmp),
                           nprocs=world, start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
