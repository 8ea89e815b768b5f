"""A guard for the "no host sync" rule, checked on the CPU: inside `forbid_host_sync()` anything that
on a GPU would make the host wait for the device raises `HostSync`. On the CPU there is no wait to
observe, so the guard recognises the operations that cause one:

1. A device value read into Python: `.item()`, `.tolist()`, `bool(t)`, `int(t)`, `float(t)`, a tensor
   used as an index. The Tensor methods are patched (`.tolist()` of a CPU tensor never reaches the
   dispatcher), and every op torch tags `data_dependent_output` is refused at dispatch
   (`aten._local_scalar_dense`, which the reads lower to from C++ too; `aten.equal`, `aten.allclose`).
2. An op whose output shape depends on the values: `x[mask]`, `masked_select`, `nonzero`,
   `torch.where(cond)`, `unique`, `bincount`, `repeat_interleave` without `output_size`, `one_hot`
   without `num_classes`. No `.item()` in sight, yet on a GPU each copies a count to the host to
   size its output. torch tags these ops `dynamic_output_shape`; the tag is per op, not per call
   (`aten.index.Tensor` carries it for integer indices, whose shape is static), so every tagged op is
   refused unless `_STATIC_WHEN` says this call's shape follows from its arguments' shapes alone, the
   same rule as torch's meta kernels. An op tagged in a later torch is refused until a rule is
   written for it. `index_put_` with a boolean index (`x[mask] = v`: a `nonzero` inside the kernel)
   has no tag and is checked by its indices.
The dispatch mode sees the ops after autograd, so the backward is checked as well as the forward.

Paths that must read the host may say so: `allow` takes `Allowance`s, each a function (file and
name) whose own host reads pass, with the reason. Only the innermost dropless frame counts, so an
allowance covers the one function, not everything it calls.

What the guard cannot see on the CPU: a device-to-host copy (`.cpu()`, `.to("cpu")`), which is a
plain copy here. What it refuses that a GPU would not wait for: a CPU kernel's own value check
(`one_hot` reads the minimum class on the CPU only; CUDA asserts on the device instead).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
aten = torch.ops.aten


class HostSync(AssertionError):
    pass


@dataclass(frozen=True)
class Allowance:
    """Host reads made directly in `function` of the dropless file ending in `file` pass (`reason`
    says why that path may wait for the device)."""

    file: str
    function: str
    reason: str


# EP exact mode sizes its all-to-alls from the exchanged counts: one host read of the split sizes per
# layer call, the mode's documented cost (docs/design.md, "Dropless guarantees, per mode"), made in
# ep_exchange.dispatch, which every EP dispatch runs.
EP_EXACT_SPLIT_SIZES = Allowance("dropless/distributed/ep_exchange.py", "dispatch",
                                 "EP exact mode reads the all-to-all split sizes, once per layer call")
# EP buffered mode with on_overflow="spill": one int of the exchanged overflow total decides, on every
# rank alike, whether the second exchange runs (EPDispatcher.dispatch_overlapped, the mode's one host read).
EP_SPILL_TOTAL = Allowance("dropless/distributed/ep.py", "dispatch_overlapped",
                           "buffered EP with spill reads the group's overflow total, once per layer call")


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


# A tagged op whose output shape follows from the arguments' shapes in this call (torch's meta rules).
_STATIC_WHEN: dict[Any, Callable[[tuple, dict], bool]] = {
    aten.index.Tensor: lambda a, k: not _bool_index(a[1]),
    aten.repeat_interleave.Tensor: lambda a, k: k.get("output_size") is not None,
    aten.one_hot.default: lambda a, k: (a[1] if len(a) > 1 else k.get("num_classes", -1)) != -1,
}
# Untagged ops that take a nonzero() of a boolean index inside their kernel.
_MASK_INDEXED = {aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default,
                 aten.index_put_.hacked_twin, aten.index_put.hacked_twin, aten._index_put_impl_.hacked_twin,
                 aten.index.Tensor_hacked_twin}


def host_sync_of(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why this op call would make a GPU wait for the host, or None."""
    if torch.Tag.data_dependent_output in func.tags:
        return "reads a device value on the host"
    if torch.Tag.dynamic_output_shape in func.tags:
        rule = _STATIC_WHEN.get(func)
        if rule is None or not rule(args, kwargs):
            return "has an output shape that depends on the values (the host reads a count to size it)"
    if func in _MASK_INDEXED and _bool_index(args[1]):
        return "indexes with a boolean mask (a nonzero() inside: the host reads its count)"
    return None


def _allowed(allow: tuple[Allowance, ...]) -> bool:
    """Whether the innermost dropless frame on the Python stack is an allowed function."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/src/dropless/" in name or "/site-packages/dropless/" in name:
            return any(name.endswith(a.file) and frame.f_code.co_name == a.function for a in allow)
        frame = frame.f_back
    return False


class _RefuseSyncingOps(TorchDispatchMode):
    def __init__(self, what: str, allow: tuple[Allowance, ...]) -> None:
        super().__init__()
        self.what, self.allow = what, allow

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = host_sync_of(func, args, kwargs)
        if why is not None and not _allowed(self.allow):
            raise HostSync(f"{self.what}: {func} {why}")
        return func(*args, **kwargs)


@contextmanager
def _patched_reads(what: str, allow: tuple[Allowance, ...]) -> Iterator[None]:
    """The Tensor methods that read a value into Python, refused (part 1 of the module note)."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def guarded(name: str) -> Callable:
        real = saved[name]

        def read(self, *args, **kwargs):
            if not _allowed(allow):
                raise HostSync(f"{what}: Tensor.{name}")
            return real(self, *args, **kwargs)

        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, guarded(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@contextmanager
def forbid_host_sync(what: str = "host sync", allow: tuple[Allowance, ...] = ()) -> Iterator[None]:
    """Refuse every host read and data-dependent output shape inside (module note), but those made
    directly in an allowed function."""
    with _patched_reads(what, allow), _RefuseSyncingOps(what, allow):
        yield
