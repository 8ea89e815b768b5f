"""Optimizer construction: AdamW with decoupled weight decay on matrices only.

`train.optimizer` picks the state precision: "adamw" is torch's AdamW (fp32 moments, 8 bytes of state
per parameter); "adamw_bf16" is `optim_lowp.AdamWBF16`, the same update with both moments stored in
bf16 (4 bytes per parameter; round-to-nearest, which suits the default beta2 = 0.95, see its notes);
"muon" is `muon.Muon`: expert-wise Muon on the matrices, AdamW (fp32 moments) on embeddings, head,
routers, norms and biases, in one optimizer object (see its notes; `train.lr` drives both halves).

All three can skip a step on the device (`step_unless`): torch's fused AdamW and AdamWBF16 read the
optimizer attribute `found_inf` (torch.amp.GradScaler's protocol: a float scalar tensor, 1.0 = skip)
and leave parameters, moments and the step count bit-identical, with no host read and no copy of the
state. That is why "adamw" is the fused implementation (torch 2.13 has fused AdamW kernels for CPU and
CUDA; its foreach and single-tensor paths refuse `found_inf`); it differs from the foreach one by an
ulp or so per step (another order of the same operations). On a device without fused kernels (e.g.
`meta`) it falls back to foreach, which cannot skip: `step_unless` then copies the parameters and
the state, steps, and puts the copies back where `skip` (`_step_then_undo`: still no host read, at the
cost of one copy of parameters + state per step).

Under `train.compile = "step"` "adamw" is instead Muon's AdamW half (a `Muon` with no matrix groups):
torch's AdamW formula with fp32 moments, written in plain tensor ops that dynamo traces into one
graph with the skip flag (torch's own optimizers break the graph around `step()` by design). It
rounds like AdamWBF16's update, so it differs from the fused kernel by an ulp or so per step, as the
foreach path does; its state has the same keys (step, exp_avg, exp_avg_sq).

No decay on one-dimensional parameters (norm gains, biases): shrinking them toward zero fights the
normalisation and buys nothing. Buffers (the router's expert bias, rotary tables) are not parameters
and are never touched by the optimizer; balancing rules move the expert bias.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import TrainConfig
from .muon import Muon, muon_param_groups
from .optim_lowp import AdamWBF16

# Devices with fused AdamW kernels (torch >= 2.4; torch.utils._foreach_utils lists them, privately).
FUSED_DEVICES = ("cpu", "cuda", "xpu", "mps")


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


def muon_ns_dtype(name: str, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """train.muon_ns_dtype resolved: "auto" follows the forward's autocast dtype (None = fp32)."""
    if name == "auto":
        return torch.bfloat16 if autocast_dtype == torch.bfloat16 else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def build_optimizer(model: nn.Module, cfg: TrainConfig,
                    autocast_dtype: torch.dtype | None = None) -> torch.optim.Optimizer:
    """The optimizer `cfg.optimizer` names; `autocast_dtype` is the forward's (for muon_ns_dtype=auto)."""
    if cfg.optimizer == "muon":
        groups, splits = muon_param_groups(model, cfg.weight_decay)
        return Muon(groups, splits, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                    weight_decay=cfg.weight_decay, ns_dtype=muon_ns_dtype(cfg.muon_ns_dtype, autocast_dtype))
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw" and cfg.compile == "step":
        # Muon's AdamW half (module note): torch's optimizers break the graph before and after step()
        # on purpose (torch/optim/optimizer.py `_use_grad`), so a compiled update could not be one graph
        return Muon([dict(g, muon=False) for g in groups], {}, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                    eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        fused = all(p.device.type in FUSED_DEVICES for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 fused=fused or None, foreach=None if fused else True)
    if cfg.optimizer == "adamw_bf16":
        return AdamWBF16(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    raise ValueError(f"train.optimizer={cfg.optimizer!r}: unknown optimizer")


def can_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours `found_inf` (module note)."""
    if isinstance(optimizer, (AdamWBF16, Muon)):
        return True
    return isinstance(optimizer, torch.optim.Adam) and all(g.get("fused") for g in optimizer.param_groups)


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor | None) -> None:
    """`optimizer.step()`, skipped on the device where `skip` (a bool scalar tensor) is true: no host
    read; parameters and optimizer state are left bit-identical."""
    if skip is None:
        optimizer.step()
        return
    if not can_skip(optimizer):
        _step_then_undo(optimizer, skip)
        return
    optimizer.found_inf = skip.float()  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


@torch.no_grad()
def _step_then_undo(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """The skip for optimizers that ignore `found_inf`: step, then `where(skip, before, after)` for
    every parameter and state tensor. State the step created (a first step) is zeroed where skipped,
    which for Adam-type optimizers is the state of one never stepped (zero moments, step 0)."""
    tensors = [p for g in optimizer.param_groups for p in g["params"]]
    before = {id(p): p.clone() for p in tensors}
    for p in tensors:
        for v in optimizer.state.get(p, {}).values():
            if torch.is_tensor(v):
                before[id(v)] = v.clone()
    optimizer.step()
    for p in tensors:
        p.copy_(torch.where(skip, before[id(p)], p))
        for v in optimizer.state.get(p, {}).values():
            if not torch.is_tensor(v):
                continue
            # A state tensor on another device (foreach AdamW keeps its step counter on the CPU)
            # needs the flag there: a copy, a host read on an accelerator. On `meta` (the device
            # tests) there are no values to restore.
            if v.device != skip.device and skip.is_meta:
                continue
            flag = skip if v.device == skip.device else skip.to(v.device)
            old = before.get(id(v))
            v.copy_(torch.where(flag, old if old is not None else torch.zeros_like(v), v))
