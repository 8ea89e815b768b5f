"""A per-token loop MoE in plain PyTorch: the executable specification the layer is tested against.

Routing (ids and weights) comes from ops.routing, which has its own tests; everything after it is a
loop over tokens and their K slots, with no permutation, no grouped GEMM and no batching.
"""

from __future__ import annotations

import torch

from dropless.layers.moe import MoELayer
from dropless.ops.activations import activation


def moe_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    x_TD = x.reshape(-1, x.shape[-1])
    decision = layer.router(x_TD)
    ids, w = decision.ids_TK, decision.weights_TK
    ex = layer.experts
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros_like(x_TD[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= ex.w_gate_up_EDF.shape[0]:  # an identity expert (layers/identity.py) returns its input
                acc = acc + w[t, j].to(x.dtype) * x_TD[t]
                continue
            h = activation(x_TD[t] @ ex.w_gate_up_EDF[e], ex.kind, ex.clamp, ex.softcap)
            acc = acc + w[t, j].to(x.dtype) * (h @ ex.w_down_EFD[e])
        rows.append(acc)
    y = torch.stack(rows)
    if layer.shared is not None:
        y = y + layer.shared(x_TD)
    return y.view(x.shape)
