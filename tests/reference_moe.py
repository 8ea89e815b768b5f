"""A per-token loop MoE in plain PyTorch: the executable specification the layer is tested against.

Routing (ids and weights) comes from ops.routing, which has its own tests; everything after it is a
loop over tokens and their K slots, with no permutation, no grouped GEMM and no batching.
"""

from __future__ import annotations

import torch

from dropless.layers.moe import MoELayer
from dropless.ops.activations import activation


def moe_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Identity experts (layers/identity.py) return their input row; under LatentMoE
    (layers/latent.py) the experts read x @ down^T (RMS-normalised when the layer has the norm) and
    their weighted sum is multiplied by up^T."""
    x_TD = x.reshape(-1, x.shape[-1])
    decision = layer.router(x_TD)
    ids, w = decision.ids_TK, decision.weights_TK
    ex = layer.experts
    lat = layer.latent
    xr = x_TD
    if lat is not None:
        xr = x_TD @ lat.down.weight.T
        if lat.norm is not None:
            xf = xr.float()
            xr = (xf / (xf.square().mean(-1, keepdim=True) + lat.norm.eps).sqrt() * lat.norm.weight).to(x.dtype)
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros_like(xr[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= ex.w_gate_up_EDF.shape[0]:  # an identity expert returns its input
                acc = acc + w[t, j].to(x.dtype) * xr[t]
                continue
            h = activation(xr[t] @ ex.w_gate_up_EDF[e], ex.kind, ex.clamp, ex.softcap)
            acc = acc + w[t, j].to(x.dtype) * (h @ ex.w_down_EFD[e])
        rows.append(acc)
    y = torch.stack(rows)
    if lat is not None:
        y = y @ lat.up.weight.T
    if layer.shared is not None:
        y = y + layer.shared(x_TD)
    return y.view(x.shape)
