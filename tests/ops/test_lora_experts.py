"""Routed-expert LoRA (ops/lora_experts.py) against the plain per-expert composition.

The Function (the lean path: `GroupedExperts.lean = True`) against `lora_experts_reference` run by
autograd (`lean = False`) on the per-expert loop: outputs, the input's, the routing weights' and all
four adapters' gradients, on the shapes that break grouped kernels. And what the backward makes: no
tensor of the size of an expert stack [E, D, W] (a materialised update or its gradient) exists.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dropless.config import MoEConfig, RouterConfig
from dropless.layers import lora
from dropless.layers.moe import MoELayer
from tests.test_lean_experts import SHAPES
from tests.tolerances import REFERENCE, assert_close

# the shapes that break grouped kernels, each with its reason (shared with the lean experts' tests)


def build(shape: str, rank: int = 4, activation: str = "swiglu", backend: str = "grouped_mm"
          ) -> tuple[MoELayer, torch.Tensor]:
    T, d, E, K, f, extra = SHAPES[shape]
    extra = dict(extra)
    bias = extra.pop("bias", None)
    cfg = MoEConfig(num_experts=E, top_k=K, d_expert=f, backend=backend, activation=activation,
                    router=RouterConfig(use_expert_bias=bias is not None), **extra)
    torch.manual_seed(0)
    layer = MoELayer(d, cfg)
    if bias is not None:
        layer.router.set_bias(torch.tensor(bias))
    lora.add_expert_adapters(layer.experts, rank if shape != "odd_widths" else 3, 2.0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name in lora.EXPERT_ADAPTERS:  # B nonzero: the adapters change the output
            p = getattr(layer.experts, name)
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    for name, p in layer.named_parameters():
        p.requires_grad_(lora.is_adapter(name))
    return layer, torch.randn(T, d, generator=torch.Generator().manual_seed(2))


def run(layer: MoELayer, x0: torch.Tensor, lean: bool) -> dict[str, torch.Tensor]:
    layer.experts.lean = lean
    layer.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    y = layer(x).y
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    (y * g).sum().backward()
    layer.experts.lean = True
    out = {"y": y.detach(), "grad x": x.grad}
    out.update({f"grad {n}": p.grad for n, p in layer.named_parameters() if p.requires_grad})
    return out


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_grouped_lora_matches_per_expert_reference(shape: str, activation: str) -> None:
    layer, x = build(shape, activation=activation)
    fast = run(layer, x, True)
    layer.experts.backend = "loop"
    ref = run(layer, x, False)
    assert fast.keys() == ref.keys() and len(fast) == 6
    for k in fast:
        assert fast[k] is not None, k
        assert_close(fast[k], ref[k], REFERENCE[torch.float32], msg=k)
    for n, p in layer.named_parameters():  # the base is frozen: no gradient was computed for it
        assert p.requires_grad or p.grad is None, n
    if shape == "empty_expert":
        for name in lora.EXPERT_ADAPTERS:
            assert torch.count_nonzero(fast[f"grad experts.{name}"][2]) == 0, name


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_function_is_the_reference_composition_bitwise(backend: str) -> None:
    """On one backend the Function runs the products autograd runs for the composition: same bits."""
    layer, x = build("basic", backend=backend)
    fast, ref = run(layer, x, True), run(layer, x, False)
    for k in fast:
        assert torch.equal(fast[k], ref[k]), k


def test_zero_b_adds_nothing() -> None:
    layer, x = build("basic")
    with torch.no_grad():
        y = layer(x).y
        layer.experts.lora_b1_ErW.zero_()
        layer.experts.lora_b2_ErD.zero_()
        y0 = layer(x).y
        for name in lora.EXPERT_ADAPTERS:
            delattr(layer.experts, name)
        assert not lora.has_expert_adapters(layer.experts)
        assert torch.equal(y0, layer(x).y)
    assert not torch.equal(y, y0)


class _Made(TorchDispatchMode):
    """The shape of every new tensor an op returns while active (views of an input are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.numels.append((str(func), tuple(t.shape)))
        return out


def test_no_expert_stack_sized_tensor_in_forward_or_backward() -> None:
    """No [E, D, W]-sized update, gradient or temporary: every tensor made in the forward and the
    backward is far below one expert stack (here E*D*W = 12288 elements, the largest row tensor
    R*W = 768). The saved tensors too, the frozen base (saved by reference) aside."""
    T, d, E, K, f = 8, 32, 8, 2, 24
    torch.manual_seed(0)
    layer = MoELayer(d, MoEConfig(num_experts=E, top_k=K, d_expert=f))
    lora.add_expert_adapters(layer.experts, 4, 2.0)
    with torch.no_grad():
        for name in lora.EXPERT_ADAPTERS:
            getattr(layer.experts, name).normal_()
    for name, p in layer.named_parameters():
        p.requires_grad_(lora.is_adapter(name))
    stack = E * d * 2 * f
    x = torch.randn(T, d, requires_grad=True)
    saved = []
    base = {layer.experts.w_gate_up_EDF.data_ptr(), layer.experts.w_down_EFD.data_ptr()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in base:
            saved.append(tuple(t.shape))
        return t

    made = _Made()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), made:
        y = layer(x).y
        y.sum().backward()
    big = [(op, s) for op, s in made.numels if torch.Size(s).numel() >= stack // 4]
    assert not big, big
    assert all(torch.Size(s).numel() < stack // 4 for s in saved), saved
    assert layer.experts.w_gate_up_EDF.grad is None and layer.experts.lora_a1_EDr.grad is not None
