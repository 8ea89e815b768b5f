"""Low-rank adapters beside the weights they adapt (train.lora, lora_config.py).

Legend: I input width, O output width, r rank, s = alpha / r; E, D, F, W as layers/experts.py.
    LoRALinear   y = x W^T + b + ((drop(x) A^T) B^T) * s      A [r, I], B [O, r] (peft's lora_A / lora_B)
    experts      a1 [E, D, r], b1 [E, r, W], a2 [E, F, r], b2 [E, r, D] on GroupedExperts itself, run
                 by ops/lora_experts.py on the grouped path's offsets

`LoRALinear` is an `nn.Linear` (same `weight` and `bias`, same names in a state dict: a base checkpoint
loads into an adapted model unchanged) with two more parameters. A starts as peft does, U(+-1/sqrt(I))
(nn.Linear's own rule), and B at zero, so an adapted model's first forward adds exactly zero to every
product and its logits are the base model's, bit for bit (tests/test_lora.py).

A fused projection (attention's q|k|v, an MLP's gate|up) gets one adapter over its whole output: one A
for the three (two) parts. peft adapts the separate q_proj, k_proj, v_proj: the export writes the same A
to each with its rows of B (hf/peft_export.py), which is the same update exactly, B_q A, B_k A, B_v A.

Freezing is the model's (model_lora.py `freeze`): every parameter but the adapters (and the router's
weights when "router" is a target) stops requiring a gradient, so autograd computes no gradient for the
base and the optimizer holds no state for it (train/optim.py takes requires_grad parameters only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import frozen_linear
from . import init

ADAPTER_NAMES = ("lora_A", "lora_B")
EXPERT_ADAPTERS = ("lora_a1_EDr", "lora_b1_ErW", "lora_a2_EFr", "lora_b2_ErD")


class LoRALinear(nn.Linear):
    """nn.Linear plus a rank-r adapter (module note)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, scale: float,
                 dropout: float = 0.0, device: torch.device | str | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.rank, self.scale, self.dropout = rank, scale, dropout
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, device=self.weight.device))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank, device=self.weight.device))

    @classmethod
    def wrap(cls, linear: nn.Linear, rank: int, scale: float, dropout: float) -> "LoRALinear":
        """An adapted copy of `linear` (built on meta at model construction: no values to copy then;
        otherwise its weight and bias are shared, not copied)."""
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, rank, scale, dropout,
                  device=linear.weight.device)
        out.weight = linear.weight
        if linear.bias is not None:
            out.bias = linear.bias
        return out

    def init_rules(self) -> dict[str, init.Rule]:
        return {"lora_A": init.uniform(self.in_features ** -0.5), "lora_B": init.const(0.0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if frozen_linear.applies(x, w, b):  # a frozen base held in bf16 (train.lora.base): computed in
            y = frozen_linear.frozen_linear(x, w, b)  # x's dtype, the cast copy not kept
        else:
            y = F.linear(x, w, b if b is None or b.dtype == w.dtype else b.to(w.dtype))
        xa = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return y + F.linear(F.linear(xa, self.lora_A), self.lora_B) * self.scale

    def merged_weight(self) -> torch.Tensor:
        """W + s B A in fp32 (merge-lora)."""
        return self.weight.float() + (self.lora_B.float() @ self.lora_A.float()) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale}"


def adapt(parent: nn.Module, name: str, rank: int, scale: float, dropout: float) -> None:
    """Replace `parent.name` (an nn.Linear) with its LoRALinear."""
    setattr(parent, name, LoRALinear.wrap(getattr(parent, name), rank, scale, dropout))


def add_expert_adapters(experts: nn.Module, rank: int, scale: float) -> None:
    """The four routed-expert adapters on a GroupedExperts (module note), on its device."""
    E, D, W = experts.w_gate_up_EDF.shape
    Fx = experts.w_down_EFD.shape[1]
    dev = experts.w_gate_up_EDF.device
    shapes = ((E, D, rank), (E, rank, W), (E, Fx, rank), (E, rank, D))
    for name, shape in zip(EXPERT_ADAPTERS, shapes):
        setattr(experts, name, nn.Parameter(torch.empty(shape, device=dev)))
    experts.lora_scale = scale


def expert_adapter_rules(experts: nn.Module) -> dict[str, init.Rule]:
    """A as peft starts it, U(+-1/sqrt(fan_in)) (D for gate|up, F for down); B zero."""
    if not has_expert_adapters(experts):
        return {}
    # the widths from the adapters: a packed base (layers/frozen_base.py) has no stacks to read
    D, Fx = experts.lora_a1_EDr.shape[1], experts.lora_a2_EFr.shape[1]
    return {"lora_a1_EDr": init.uniform(D ** -0.5), "lora_b1_ErW": init.const(0.0),
            "lora_a2_EFr": init.uniform(Fx ** -0.5), "lora_b2_ErD": init.const(0.0)}


def has_expert_adapters(experts: nn.Module) -> bool:
    # a dict lookup, not getattr: nn.Module's __getattr__ raises and catches on every expert call of a
    # run without adapters
    return "lora_a1_EDr" in experts._parameters


def expert_adapters(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(getattr(experts, n) for n in EXPERT_ADAPTERS)  # type: ignore[return-value]


def merged_expert_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 + s a1 b1, w2 + s a2 b2) per expert, fp32 (merge-lora): an [E, D, W] product, formed here
    once, never in training. A base held narrow (layers/frozen_base.py) merges into the weights the
    adapters trained against: its dequantised values."""
    a1, b1, a2, b2 = (t.float() for t in expert_adapters(experts))
    s = experts.lora_scale
    read = getattr(experts, "dequant_base", None)
    w1, w2 = read(torch.float32)() if read is not None else (experts.w_gate_up_EDF.float(),
                                                             experts.w_down_EFD.float())
    return w1 + torch.bmm(a1, b1) * s, w2 + torch.bmm(a2, b2) * s


def is_adapter(name: str) -> bool:
    """Whether a parameter name (any prefix) is an adapter's."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ADAPTER_NAMES or leaf in EXPERT_ADAPTERS
