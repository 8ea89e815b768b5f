"""Gated and plain activations on the prefused gate|up product.

Legend: R routed rows, F expert hidden width. `h_R2F` holds [gate | up] side by side, the output of
one GEMM against w_gate_up (so the input rows are read once, not twice).

Clamps: `clamp` is a hard clamp of the gate and up pre-activations to [-c, c] (c = 10 in DeepSeek-V4
style models; it bounds the largest activation, which matters for low-precision GEMMs whose scales
follow the block maximum). `softcap` is a smooth alternative, c * tanh(x / c), with a gradient that
never becomes exactly zero. Both are optional; clamp wins when both are set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _cap(x: torch.Tensor, clamp: float | None, softcap: float | None) -> torch.Tensor:
    if clamp is not None:
        return x.clamp(-clamp, clamp)
    if softcap is not None:
        return softcap * torch.tanh(x / softcap)
    return x


def is_gated(kind: str) -> bool:
    return kind in ("swiglu", "geglu")


def activation(h: torch.Tensor, kind: str, clamp: float | None = None,
               softcap: float | None = None) -> torch.Tensor:
    """Apply `kind` to the last dimension: [.., 2F] -> [.., F] for gated kinds, [.., F] -> [.., F] else."""
    if kind == "relu2":
        return F.relu(_cap(h, clamp, softcap)).square()
    gate, up = h.chunk(2, dim=-1)
    gate, up = _cap(gate, clamp, softcap), _cap(up, clamp, softcap)
    if kind == "swiglu":
        return F.silu(gate) * up
    if kind == "geglu":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"activation={kind!r}: must be one of swiglu, geglu, relu2")
