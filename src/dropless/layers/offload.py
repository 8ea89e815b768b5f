"""Activation offload: what autograd saves inside named parts of a block goes to host memory in the
forward and comes back in the backward.

Legend: no MoE shapes here; a *storage* is the memory every view of a tensor shares (as in
saved_bytes.py, whose keying this file follows).

`model.offload` names module scopes of each block (docs/offload.md):
    layer       the whole block (both norms, attention, the MLP or the MoE layer)
    attn        the attention module (qkv, rotary, SDPA, output projection)
    attn_input  the attention's qkv projection: it saves its input, the normed hidden state (or its
                autocast copy), and its weight (a parameter: kept in place)
    norm        the block's two RMSNorms
    moe         the MoE layer (router, dispatch, experts, combine, shared experts; MoE blocks only)
    experts     the routed experts module: every tensor it saves (today its gathered input rows, the
                pre-activation and the activation; after the lean rewrite whatever that saves)

Why by module scope: `torch.autograd.graph.saved_tensors_hooks` sees every tensor any op or custom
Function saves (`save_for_backward`) while the scope runs, whatever the code inside does; naming the
internal tensors of one experts implementation would break the day it changes. So `experts` is the
finest expert scope: the experts' fc1 input is not a module boundary (the GEMM is a function inside
the experts, and the lean experts re-gather their rows from the layer input instead of saving them).

The mechanism, per scope call:
- pack (forward): a parameter, or any tensor sharing a storage with one (or with the scope's other
  `keep` tensors: the rotary tables), is left in place: autograd saves it by reference and it lives
  for the whole run anyway. Anything else has its whole storage copied once into a fresh host
  storage the hook owns (a second view of an already copied storage reuses the copy), and autograd
  keeps the copy plus the view's geometry instead of the tensor. The original is referenced until
  the scope exits (so that no freed storage's address can be reused by another storage within the
  scope and found in the copy table), then released.
- unpack (backward): the first unpack of a storage brings it back to its device (on the CPU the host
  copy is returned as it is), later views of it reuse that; the view is rebuilt with the saved
  offset, size and stride.
- CUDA: pinned host storages (torch's caching host allocator pools them); the copies run on one side
  stream per device, after the compute stream's work so far (wait_stream); the source is marked used
  by that stream (record_stream) so the caching allocator cannot hand its memory out before the
  copy is done; the way back waits for that stream, and the compute stream waits for the way back.
  The restore is on demand (no prefetch): it overlaps nothing yet. Not run on a GPU in this change.
- Numerics: a byte copy and back; the backward reads the same bytes at the same geometry, so the
  gradients are bit-identical to no offload (tests/test_offload.py, CPU fp32, torch.equal).
- Autocast: the bf16 copies of weights that autograd saves are not parameters and are offloaded
  (autocast's cast cache drops them when the forward leaves autocast, so only autograd keeps them).

The counter (`OffloadCounter`, one per `Offloader`, which the model owns: never a global) adds up
host-side metadata only (sizes), so counting never syncs the device.

Offload and recompute of overlapping scopes are refused by the config (config.check_offload): a
checkpoint's own hooks would shadow these inside its region, and a recompute would re-enter an inner
offload scope, giving the checkpoint a different set of saved tensors than its forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass
class OffloadCounter:
    """What the offload hooks moved since the last `take()` (host ints, no device sync)."""

    tensors: int = 0  # saved tensors packed to host (views of one storage each count)
    storages: int = 0  # distinct storages copied to host
    bytes_to_host: int = 0  # their bytes
    bytes_to_device: int = 0  # bytes brought back in the backward (first unpack of each storage)
    kept: int = 0  # saved tensors left in place: parameters (and views of them), the keep tensors

    def take(self) -> OffloadCounter:
        """A copy of the counts, which are then reset."""
        out = dataclasses.replace(self)
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)
        return out


class _HostCopy:
    """One storage's bytes in host memory, and (after the first unpack) back on its device."""

    def __init__(self, t: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        src = t.untyped_storage()
        self.device, self.nbytes, self.stream = t.device, src.nbytes(), stream
        self.restored: torch.UntypedStorage | None = None
        if stream is None:  # CPU: a fresh storage of the host pool
            self.host = torch.UntypedStorage(self.nbytes)
            self.host.copy_(src)
            return
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written
        host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(src), non_blocking=True)
        t.record_stream(stream)  # the allocator must not reuse t's memory before the copy is done
        self.host = host.untyped_storage()

    def restore(self) -> torch.UntypedStorage:
        if self.restored is not None:
            return self.restored
        if self.stream is None:
            self.restored = self.host
            return self.host
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the device buffer below may reuse memory current used
        with torch.cuda.stream(self.stream):  # after the way out (same stream)
            back = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            back.copy_(torch.empty(0, dtype=torch.uint8).set_(self.host), non_blocking=True)
        current.wait_stream(self.stream)
        back.record_stream(current)
        self.restored = back.untyped_storage()
        return self.restored


class OffloadScope:
    """A context: what autograd saves inside goes to host (module note). `keep`: tensors whose
    storages stay in place besides parameters (constants the scope reads, e.g. the rotary tables)."""

    def __init__(self, offloader: Offloader, keep: Iterable[torch.Tensor] = ()) -> None:
        self.offloader = offloader
        self.keep = {_key(t) for t in keep}
        self.copies: dict[int, tuple[_HostCopy, torch.UntypedStorage]] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def __enter__(self) -> OffloadScope:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)
        self.copies.clear()  # the originals are released here

    def pack(self, t: torch.Tensor) -> Any:
        count = self.offloader.counter
        if (isinstance(t, nn.Parameter) or type(t) is not torch.Tensor or t.layout != torch.strided
                or t.device.type not in ("cpu", "cuda") or _key(t) in self.keep):
            count.kept += 1
            return t
        key = _key(t)
        if key not in self.copies:
            copy = _HostCopy(t, self.offloader.stream(t.device))
            self.copies[key] = (copy, t.untyped_storage())
            count.storages += 1
            count.bytes_to_host += copy.nbytes
        count.tensors += 1
        return self.copies[key][0], t.dtype, t.storage_offset(), t.size(), t.stride()

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        copy, dtype, offset, size, stride = packed
        if copy.restored is None:
            self.offloader.counter.bytes_to_device += copy.nbytes
        storage = copy.restore()
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


class Offloader:
    """Offload scopes sharing one counter and one side stream per CUDA device. The model owns one
    (`MoEModel.offloader`); the trainer or a bench reads `counter` (and `take()`s it)."""

    def __init__(self) -> None:
        self.counter = OffloadCounter()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def scope(self, keep: Iterable[torch.Tensor] = ()) -> OffloadScope:
        return OffloadScope(self, keep)


class _ModuleScope:
    """Forward hooks that run a module's forward inside an offload scope (for scopes inside another
    module's forward, e.g. attention's qkv projection). A bound-method pair, so that deep-copying
    the model copies the offloader they use with it."""

    def __init__(self, offloader: Offloader) -> None:
        self.offloader = offloader
        self.open: list[OffloadScope | None] = []

    def enter(self, module: nn.Module, args: object) -> None:
        scope = None
        if torch.is_grad_enabled():
            scope = self.offloader.scope(module.parameters())
            scope.__enter__()
        self.open.append(scope)

    def exit(self, module: nn.Module, args: object, out: object) -> None:
        scope = self.open.pop()
        if scope is not None:
            scope.__exit__(None, None, None)


def attach(module: nn.Module, offloader: Offloader) -> None:
    """Offload what `module`'s forward saves, whoever calls it (while autograd records)."""
    hooks = _ModuleScope(offloader)
    module.register_forward_pre_hook(hooks.enter)
    module.register_forward_hook(hooks.exit, always_call=True)
