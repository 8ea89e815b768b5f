"""What a step runs after its backward passes, eager or compiled: the gradient norm and the update.

`StepFns` is what `Trainer.train_step` calls for them. With `train.compile = "step"` (compiling.py's
module note) it also holds the whole model compiled in place, and `grad_norm` and `update` are each
one graph (fullgraph): the norm over every gradient and its clipping, and the optimizer's step with
the device-side skip flag (optim.step_unless), which dynamo traces through dropless's optimizers
(Muon, AdamWBF16, and under "step" AdamW as Muon's AdamW half: optim.build_optimizer says why).
`train.cuda_graphs` compiles all three with inductor's "reduce-overhead" mode, which records each
graph's kernels once as a CUDA graph and replays them (CUDA only: refused elsewhere, before the run
starts).

Each graph falls back to eager on its own, with one CompileFallback warning, if its first call fails
(the same rule as compiling.CompiledBlocks); the model graph is CompiledBlocks itself.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from ..config import TrainConfig
from . import compiling
from .layout import Layout
from .optim import step_unless


class CompiledFn:
    """`fn` compiled (fullgraph), or eager once its first call failed (module note)."""

    def __init__(self, fn: Callable, name: str, backend: str | Callable, mode: str | None) -> None:
        self.fn, self.name, self.backend = fn, name, backend
        self.compiled = torch.compile(fn, fullgraph=True, backend=backend,
                                      **({"mode": mode} if mode is not None else {}))
        self.failed: str | None = None
        self._first = True

    def __call__(self, *args: Any) -> Any:
        if self.failed is not None:
            return self.fn(*args)
        if not self._first:
            return self.compiled(*args)
        try:
            out = self.compiled(*args)
        except Exception as err:  # a tracing or backend failure: the step is still to be done
            self.failed = f"the first compiled call failed: {compiling._describe(err)}"
            warnings.warn(f"train.compile=step ({self.name}): {self.failed}; it runs eager",
                          compiling.CompileFallback, stacklevel=2)
            return self.fn(*args)
        self._first = False
        return out


class StepFns:
    """grad_norm() -> the global gradient norm (clipped to grad_clip unless 0); update(skip) -> the
    optimizer step unless `skip`. `model_graph`: the compiled model under "step", else None."""

    def __init__(self, layout: Layout, model: nn.Module, optimizer: torch.optim.Optimizer,
                 grad_clip: float) -> None:
        self.layout, self.model, self.optimizer, self.grad_clip = layout, model, optimizer, grad_clip
        self.model_graph: compiling.CompiledBlocks | None = None
        self.grad_norm: Callable[[], torch.Tensor] = self._grad_norm
        self.update: Callable[[torch.Tensor | None], None] = self._update

    def _grad_norm(self) -> torch.Tensor:
        return self.layout.finish_grads(self.model, self.grad_clip)

    def _update(self, skip: torch.Tensor | None) -> None:
        step_unless(self.optimizer, skip)

    def compile(self, backend: str | Callable, mode: str | None) -> None:
        self.model_graph = compiling.CompiledBlocks([self.model], backend, train_only=True, mode=mode,
                                                    what="train.compile=step")
        self.grad_norm = CompiledFn(self._grad_norm, "gradient norm", backend, mode)
        self.update = CompiledFn(self._update, "optimizer update", backend, mode)


def check_cuda_graphs(t: TrainConfig, device: torch.device) -> None:
    if t.cuda_graphs and device.type != "cuda":
        raise ValueError(f"train.cuda_graphs=true: CUDA graphs capture CUDA kernels, and this run is on "
                         f"{device.type!r} (train.device={t.device!r}); leave it off")


def build_step_fns(t: TrainConfig, layout: Layout, model: nn.Module, optimizer: torch.optim.Optimizer) -> StepFns:
    """The eager functions, compiled under train.compile = "step" with train.compile_backend unless
    the backend cannot (compiling.compiler_problem: one warning, eager)."""
    fns = StepFns(layout, model, optimizer, t.grad_clip)
    if t.compile != "step":
        return fns
    check_cuda_graphs(t, layout.device)
    backend = compiling.BACKENDS[t.compile_backend]
    problem = compiling.compiler_problem(layout.device, backend)
    if problem is not None:
        warnings.warn(f"train.compile=step: {problem}; training continues eager", compiling.CompileFallback,
                      stacklevel=2)
        return fns
    fns.compile(backend, "reduce-overhead" if t.cuda_graphs else None)
    return fns
