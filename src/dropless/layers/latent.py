"""LatentMoE, `moe.latent_dim` (docs/model_knobs.md): the routed experts run in a width l < d.

Legend: T tokens, D model width, L latent width (l).

    x_TD -> router (in D: the routing decision sees the full token)
    x_TD -> down [D -> L] -> (RMSNorm, `moe.latent_norm`) -> x_TL -> dispatch -> experts (L -> F -> L)
         -> combine -> y_TL -> up [L -> D] -> + shared experts (in D) -> y_TD

Why: dispatch moves rows of width l instead of d (all-to-all bytes shrink by d / l under expert
parallelism) and both expert GEMMs shrink by the same factor, so at equal cost a model can have more
or wider experts. The two projections are dense per-token GEMMs every token pays once, outside the
routed part (not multiplied by K). The shared experts stay in D: they are the layer's dense path.

Everything after `down` sees an ordinary MoE layer of width l: the dispatcher's rows, the lean
experts' re-gather (layers/experts.py re-gathers from the token rows handed to dispatch: here the
latent rows x_TL, which the dispatcher's RowSource holds), the decode path, identity experts (they
return their latent input, which `up` then projects like any expert's output) and the monitor's
per-expert statistics (measured in l).

Init: both projections normal with std fan_in^-1/2, so the latent rows and the layer's output keep
the scale of the plain layer's at init.

The norm is the model's RMSNorm (layers/norm.py), over the l latent features.
"""

from __future__ import annotations

import torch
from torch import nn

from . import init
from .norm import RMSNorm


class LatentProjection(nn.Module):
    def __init__(self, d_model: int, latent_dim: int, norm: bool, eps: float = 1e-6) -> None:
        super().__init__()
        self.down = nn.Linear(d_model, latent_dim, bias=False)
        self.up = nn.Linear(latent_dim, d_model, bias=False)
        self.norm = RMSNorm(latent_dim, eps) if norm else None
        init.apply_rules(self)

    def init_rules(self) -> dict[str, init.Rule]:
        return {"down.weight": init.normal(self.down.in_features ** -0.5),
                "up.weight": init.normal(self.up.in_features ** -0.5)}

    def project_down(self, x_TD: torch.Tensor) -> torch.Tensor:
        x_TL = self.down(x_TD)
        return self.norm(x_TL) if self.norm is not None else x_TL

    def project_up(self, y_TL: torch.Tensor) -> torch.Tensor:
        return self.up(y_TL)
