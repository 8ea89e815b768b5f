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

`count_held=True` also counts what the forward keeps without saving it: every storage an op created
during the call that is still alive after it (recorded by a `TorchDispatchMode`, read after a
garbage collection), except the output's own storages unless something saved them. That is how a
checkpointed region's inputs are counted: non-reentrant `torch.utils.checkpoint` keeps them by
reference in its recompute closure (not as saved tensors), and inside the region its own hooks
shadow this counter's. The same rule as tests/test_recompute.py's `held_bytes`, less the output.

Not seen: tensors a custom Function stashes as plain `ctx` attributes instead of saving them (the
hooks never see those; dropless's own Functions save every tensor through `save_for_backward`).
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


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


class _Created(TorchDispatchMode):
    """Every storage an op creates during the mode, by weak reference, with its first tensor's
    shape and dtype (a storage address freed and reused keeps the latest entry)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, tuple[int, ...], torch.dtype, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if _key(t) not in self.storages or self.storages[_key(t)][0].expired():
                    self.storages[_key(t)] = (StorageWeakRef(st), tuple(t.shape), t.dtype, st.nbytes())
        return out


def saved_bytes(fn: Callable[..., Any], *args: Any, exclude: Iterable[torch.Tensor] = (),
                include_inputs: bool = True, count_held: bool = False, **kwargs: Any) -> SavedBytes:
    """Run `fn(*args, **kwargs)` with grad enabled and count what autograd saves for its backward
    (plus the tensor arguments in `args`, unless `include_inputs=False`; plus, with `count_held`,
    what the forward created and still holds, its outputs excepted: module note)."""
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

    created = _Created() if count_held else nullcontext()
    held: dict[int, tuple[tuple[int, ...], torch.dtype, int]] = {}
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), created:
        out = fn(*args, **kwargs)
    if count_held:
        gc.collect()
        outputs = {_key(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
        for key, (ref, shape, dtype, nbytes) in created.storages.items():
            if ref.expired() or key in seen or key in excluded_keys or key in outputs:
                continue
            held[key] = (shape, dtype, nbytes)
    items = tuple((shape, dtype, s.nbytes()) for s, shape, dtype in seen.values()) + tuple(held.values())
    return SavedBytes(sum(n for *_, n in items), len(items), counts["tensors"], counts["excluded"], out, items)


class AliveStorages(TorchDispatchMode):
    """Every storage an op creates while the mode is on, by weak reference, keyed by address (a freed
    address reused later is the later storage); a storage counts once however many views it has.
    What a forward leaves alive is what its graph keeps (saved tensors, a checkpoint's inputs) plus
    its outputs: the planner's validation and the recompute/offload tests measure with it, a count
    independent of `saved_bytes`' hooks. `alive_bytes` reads each live storage's size now: FSDP2
    frees a resharded unit's gathered parameters by resizing their storage to 0, while tensors that
    autograd saved still hold the (empty) storage object."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.storages[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        return out

    def alive_bytes(self, skip: set[int] = frozenset()) -> int:
        """Bytes of the storages still alive, less those whose address is in `skip`."""
        gc.collect()
        return sum(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
                   for ptr, (ref, _) in self.storages.items() if not ref.expired() and ptr not in skip)

    def settled_bytes(self, skip: set[int] = frozenset(), agree: int = 3, interval_s: float = 0.02,
                      timeout_s: float = 5.0) -> int:
        """`alive_bytes` once it stops falling: `agree` equal readings `interval_s` apart (at most
        `timeout_s`, then the lowest seen). Another thread can hold a storage for a moment after the
        op that made it has returned: gloo's worker thread marks an all-to-all done, then takes its
        lock back before it drops the work, and the work holds the exchange's input and output. On a
        busy 2-core machine that thread can wait a scheduler slice, and a single reading counted an
        all-to-all's two buffers as activations. Only releases can happen while nothing runs, so
        the settled reading is the lowest."""
        low = self.alive_bytes(skip)
        same, deadline = 1, time.monotonic() + timeout_s
        while same < agree and time.monotonic() < deadline:
            time.sleep(interval_s)
            now = self.alive_bytes(skip)
            same = same + 1 if now == low else 1
            low = min(low, now)
        return low
