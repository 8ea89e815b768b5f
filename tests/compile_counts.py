"""Dynamo's count of graphs built, step by step, for the compiled-step tests (one process and gloo
worlds alike: tests/ is on the import path of both)."""

from __future__ import annotations

import warnings

from torch._dynamo.utils import counters

from dropless.train import compiling
from dropless.train.loop import Trainer


def graphs_per_step(trainer: Trainer) -> list[int]:
    """Run `trainer.fit()`; dynamo's count of graphs built so far, after each optimizer step. A
    fallback to eager (CompileFallback) is an error."""
    seen: list[int] = []
    real = trainer.train_step

    def counted(step: int, log_step: bool = False):
        out = real(step, log_step)
        seen.append(counters["stats"]["unique_graphs"])
        return out

    trainer.train_step = counted  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("error", compiling.CompileFallback)  # a fallback would run eager
        trainer.fit()
    return seen
