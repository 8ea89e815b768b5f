"""Optimizer construction: AdamW with decoupled weight decay on matrices only.

No decay on one-dimensional parameters (norm gains, biases): shrinking them toward zero fights the
normalisation and buys nothing. Buffers (the router's expert bias, rotary tables) are not parameters
and are never touched by the optimizer; balancing rules move the expert bias.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainConfig


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
    raise ValueError(f"train.optimizer={cfg.optimizer!r}: unknown optimizer")
