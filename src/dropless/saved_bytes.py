"""Count the bytes autograd keeps for the backward pass of any forward computation.

Every tensor an op saves for its backward (`ctx.save_for_backward` in custom Functions, the
inputs/outputs built-in ops keep) passes through `torch.autograd.graph.saved_tensors_hooks`' pack
hook. The counter sits there and adds up *storages*, not tensors: a view keeps its whole storage
alive, and many ops save views (a transposed weight, a slice of a fused projection), so one storage
saved as three views costs its bytes once, and a view of a big buffer costs the whole buffer.

Storages are keyed by identity (`untyped_storage()._cdata`, the address of the storage object, which
every view shares); `data_ptr` would do on real devices but is 0 for every meta tensor, and counting
on the meta device (no allocation) is what a memory planner wants. The counter holds a reference to
each storage it has seen until it returns, so no storage can be freed and its address reused by
another during the count (which also means: do not read peak memory inside a count).

Excluded: the storages of parameters and buffers (of `fn` when it is a module, plus `exclude`):
they live for the whole run whatever the backward keeps. Included (by default): the storages of the
tensor arguments, whether or not an op saves them: something must keep a layer's input until its
backward (the analytic floor counts it too), and a layer that casts its input and saves only the
cast copy would otherwise look as if it kept nothing of it. `include_inputs=False` counts only what
autograd itself saves.

Not seen: tensors a custom Function stashes as plain `ctx` attributes instead of saving them (the
hooks never see those; dropless's own Functions save every tensor through `save_for_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch


@dataclass(frozen=True)
class SavedBytes:
    bytes: int  # total bytes of the distinct saved storages (excluded ones left out)
    storages: int  # distinct storages counted
    tensors: int  # tensors packed for backward (views of one storage each count here)
    excluded: int  # packed tensors whose storage is a parameter's or buffer's (not in bytes)
    out: Any  # what the forward returned (keeps the graph alive until dropped)
    # per counted storage, in the order first seen: (shape, dtype) of its first tensor, its bytes
    items: tuple[tuple[tuple[int, ...], torch.dtype, int], ...] = ()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def saved_bytes(fn: Callable[..., Any], *args: Any, exclude: Iterable[torch.Tensor] = (),
                include_inputs: bool = True, **kwargs: Any) -> SavedBytes:
    """Run `fn(*args, **kwargs)` with grad enabled and count what autograd saves for its backward
    (plus the tensor arguments in `args`, unless `include_inputs=False`)."""
    constants = list(exclude)
    if isinstance(fn, torch.nn.Module):
        constants += list(fn.parameters()) + list(fn.buffers())
    excluded_keys = {_key(t) for t in constants}
    seen: dict[int, tuple[torch.UntypedStorage, tuple[int, ...], torch.dtype]] = {}
    counts = {"tensors": 0, "excluded": 0}

    def add(t: torch.Tensor) -> None:
        key = _key(t)
        if key not in seen and key not in excluded_keys:
            seen[key] = (t.untyped_storage(), tuple(t.shape), t.dtype)

    def pack(t: torch.Tensor) -> torch.Tensor:
        counts["tensors"] += 1
        if _key(t) in excluded_keys:
            counts["excluded"] += 1
        add(t)
        return t

    if include_inputs:
        for a in args:
            if isinstance(a, torch.Tensor):
                add(a)

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    items = tuple((shape, dtype, s.nbytes()) for s, shape, dtype in seen.values())
    return SavedBytes(sum(n for *_, n in items), len(items), counts["tensors"], counts["excluded"], out, items)
