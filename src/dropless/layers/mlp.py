"""A dense gated MLP: the dense layers of the model and the shared experts of an MoE layer.

Legend: T tokens, D model width, F hidden width. Gate and up are one prefused weight (D -> 2F), so
the input is read once. n shared experts of width f are one MLP of width n*f: the sum of n gated
MLPs equals one MLP over their concatenated hidden units. SwiGLU without clamp or softcap takes the
experts' fused op (`weighted_swiglu` with no weights: one autograd node, silu kept, gate and up
gradients written into one buffer); every other activation takes the generic path.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.activations import activation, is_gated, weighted_swiglu
from . import init


class MLP(nn.Module):
    def __init__(self, d_model: int, d_hidden: int, kind: str = "swiglu", clamp: float | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.kind, self.clamp, self.softcap = kind, clamp, softcap
        width = 2 * d_hidden if is_gated(kind) else d_hidden
        self.gate_up = nn.Linear(d_model, width, bias=False)
        self.down = nn.Linear(d_hidden, d_model, bias=False)
        init.apply_rules(self)

    def init_rules(self) -> dict[str, init.Rule]:
        """N(0, 1/fan_in) for both projections (layers/init.py)."""
        return {"gate_up.weight": init.normal(self.gate_up.in_features ** -0.5),
                "down.weight": init.normal(self.down.in_features ** -0.5)}

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:  # any leading dims: [..., D]
        h = self.gate_up(x_TD)
        if self.kind == "swiglu" and self.clamp is None and self.softcap is None:
            # the width spelled out, not -1: a rank with no tokens still runs its shared experts
            a = weighted_swiglu(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], h.shape[-1] // 2)
        else:
            a = activation(h, self.kind, self.clamp, self.softcap)
        return self.down(a)
