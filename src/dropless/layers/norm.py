"""RMSNorm, shared by the model's blocks and the attention variants (model.py, layers/mla.py).

The forward is `ops.rms_norm.rms_norm_reference` (normalise in fp32: the mean of squares of bf16
activations loses the small ones); the module runs it as one autograd Function with a closed-form
backward (`ops.rms_norm.rms_norm`: the same output bits, about half the backward's passes).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.rms_norm import rms_norm
from . import init


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def init_rules(self) -> dict[str, init.Rule]:
        return {"weight": init.const(1.0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
