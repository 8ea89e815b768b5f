"""What the compile tests look at in dynamo's work: the count of graphs built, step by step, and the
host reads inside the graphs (one process and gloo worlds alike: tests/ is on the import path of
both)."""

from __future__ import annotations

import warnings

import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters

from host_sync import HOST_READS

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


def reading_backend(reads: list[str]):
    """aot_eager, noting every host read in the graphs dynamo hands it, branches included, as
    "target(first argument)": dynamo traces `int(t)` or `float(t)` into the graph as `item` without a
    graph break, so fullgraph alone misses it."""
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        for m in gm.modules():
            if isinstance(m, torch.fx.GraphModule):
                reads.extend(f"{n.target}({n.args[0] if n.args else ''})" for n in m.graph.nodes
                             if str(n.target) in HOST_READS or "_local_scalar_dense" in str(n.target))
        return aot_eager(gm, example_inputs)
    return backend
