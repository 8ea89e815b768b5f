"""Optimizer construction: AdamW with decoupled weight decay on matrices only.

`train.optimizer` picks the state precision: "adamw" is torch's AdamW (fp32 moments, 8 bytes of state
per parameter); "adamw_bf16" is `optim_lowp.AdamWBF16`, the same update with both moments stored in
bf16 (4 bytes per parameter; round-to-nearest, which suits the default beta2 = 0.95, see its notes).

No decay on one-dimensional parameters (norm gains, biases): shrinking them toward zero fights the
normalisation and buys nothing. Buffers (the router's expert bias, rotary tables) are not parameters
and are never touched by the optimizer; balancing rules move the expert bias.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainConfig
from .optim_lowp import AdamWBF16


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    seen: set[int] = set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 foreach=True)
    if cfg.optimizer == "adamw_bf16":
        return AdamWBF16(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    raise ValueError(f"train.optimizer={cfg.optimizer!r}: unknown optimizer")
