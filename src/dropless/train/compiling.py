"""`train.compile`: torch.compile of the blocks or of the whole step, with one clear fallback to eager.

"blocks" (true): every block of a model has the same code, so dynamo traces one graph per block
instance (guards on the module identity) from the same Python, and a graph is small enough to compile
in seconds to a minute; the embedding, the final norm, the LM head and the cross-entropy stay eager.

"step" (train/compile_step.py): the whole model's forward with its losses is one graph, whose
backward AOTAutograd builds with it, and the gradient norm and the optimizer update are graphs of
their own; what stays eager is the host's bookkeeping between them (the micro-batch loop, the
statistics' accumulation, the balancing rules). Static shapes: the batch is [B, S] and the dropless
expert batch is bounded by T*K + E*(align-1) rows (layers/dispatch.py), so nothing recompiles as the
routing changes. Calls without autograd (evaluation, the routing monitor's probe) run eager: the
training graphs are the only ones built, and evaluation never triggers a compile mid-run.

fullgraph=True: a block (attention, norms, the MoE layer) is one graph or an error. A graph break in
the MoE layer would be a host read of device data (`.item()`, a Python branch on a tensor), which the
layer does not have (tests/test_compile.py proves it for the layer alone); failing loudly keeps it so.
Shapes: the ragged expert groups are device tensors (counts and offsets fed to grouped_mm), not
shapes, so the training batch [B, S] gives static shapes; `dynamic=None` (torch's default) compiles
the first shape static and marks a dimension dynamic when a second size shows up (the evaluation
batch), one recompile instead of one per size.

Compiled in place (`nn.Module.compile`): parameter names, `state_dict` keys and checkpoints are the
same as eager, and the optimizer holds the same parameters.

Any dtype: torch's grouped_mm traces with bf16 operands only; fp32 experts go through a custom op
with the same kernel (ops/grouped_mm_op.py).

Fallback, decided twice:
1. Up front: inductor writes C++ (CPU) or Triton (CUDA) kernels; without a working C++ compiler or
   without triton it cannot (`compiler_problem`), and compile is not attempted.
2. At the first call of each compiled module: dynamo traces and inductor builds the forward there; its backward
   is normally built lazily at the first backward, where an error would surface inside
   `loss.backward()` with no way back, so the first call forces the backward to be built with the
   forward (`force_non_lazy_backward_lowering`). Any exception there turns compile off for every block
   (a model half compiled would be neither path) and the call runs eager.
Both say so with one warning (`warnings.warn`, category CompileFallback) naming the reason.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn

# train.compile_backend -> what torch.compile is given: inductor builds kernels; aot_eager traces the
# same graphs (dynamo, AOTAutograd) and runs them with the eager kernels: a check of the tracing
# (graph breaks, recompiles) in seconds, without the minutes of a C++ or Triton build
BACKENDS: dict[str, str | Callable] = {"inductor": "inductor", "aot_eager": "aot_eager"}


class CompileFallback(UserWarning):
    """train.compile could not compile; the run continues eager."""


def compiler_problem(device: torch.device, backend: str | Callable) -> str | None:
    """Why `backend` cannot build kernels on `device`, or None when it can (as far as can be told
    before compiling; the first call catches the rest)."""
    if backend != "inductor":
        return None
    if device.type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()  # runs `<cxx> --version` on the candidates
        except Exception as err:  # InvalidCxxCompiler, or an import error on a stripped install
            return f"no working C++ compiler for inductor's CPU kernels ({type(err).__name__}: {err})".strip()
        return None
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "triton is not installed (inductor's CUDA kernels need it)"
    return f"inductor has no kernels for device {device.type!r}"


class CompiledBlocks:
    """The blocks of one model compiled in place, and the switch that turns them back to eager.

    `enabled` (default True) selects the compiled call; False runs every block's plain forward (the
    bench times both paths on one model and one optimizer). `failed` holds the reason once the first
    call failed; compile then stays off."""

    def __init__(self, blocks: Sequence[nn.Module], backend: str | Callable, train_only: bool = False,
                 mode: str | None = None, what: str = "train.compile=blocks") -> None:
        """`train_only`: calls without autograd run eager (the whole-step mode's evaluation)."""
        self.blocks = list(blocks)
        self.backend = backend
        self.enabled = True
        self.failed: str | None = None
        self.train_only, self.what = train_only, what
        self._first = True
        for block in self.blocks:
            block.compile(fullgraph=True, dynamic=None, backend=backend,
                          **({"mode": mode} if mode is not None else {}))
            # nn.Module.__call__ runs `_compiled_call_impl` when set: put the guard in front of it
            compiled = block._compiled_call_impl
            block._compiled_call_impl = self._guarded(block, compiled)

    def _guarded(self, block: nn.Module, compiled: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled or self.failed is not None or (self.train_only and not torch.is_grad_enabled()):
                return block._call_impl(*args, **kwargs)
            if not self._first:
                return compiled(*args, **kwargs)
            try:
                with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                    out = compiled(*args, **kwargs)
            except Exception as err:  # any backend or tracing failure: module note, item 2
                self._fail(f"the first compiled call failed: {_describe(err)}")
                return block._call_impl(*args, **kwargs)
            if block is self.blocks[-1]:
                self._first = False  # every block has been built once
            return out

        return call

    def _fail(self, why: str) -> None:
        self.failed = why
        warnings.warn(f"{self.what}: {why}; training continues eager", CompileFallback, stacklevel=3)


def _describe(err: BaseException) -> str:
    """The exception's type and first line, and its root cause's (dynamo wraps a backend's error in
    BackendCompilerFailed, whose own message is only "backend='...' raised:")."""
    def line(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__

    root = err
    while getattr(root, "inner_exception", None) or root.__cause__:
        root = getattr(root, "inner_exception", None) or root.__cause__
    return line(err) if root is err else f"{line(err)} {line(root)}"


def compile_blocks(model: nn.Module, device: torch.device, backend: str | Callable | None = None,
                   train_only: bool = False) -> CompiledBlocks | None:
    """Compile every block of `model` (its `blocks` list) in place with `backend` (a
    train.compile_backend name; default inductor); `train_only`: calls without autograd run eager.
    None, with one CompileFallback warning, where `compiler_problem` says it cannot compile."""
    backend = BACKENDS[backend or "inductor"]
    problem = compiler_problem(device, backend)
    if problem is not None:
        warnings.warn(f"train.compile=blocks: {problem}; training continues eager", CompileFallback, stacklevel=2)
        return None
    return CompiledBlocks(model.blocks, backend, train_only=train_only)
