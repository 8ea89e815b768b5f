"""The fused weighted SwiGLU against its plain-PyTorch reference: output and every gradient."""

from __future__ import annotations

import pytest
import torch

from dropless.ops.activations import weighted_swiglu, weighted_swiglu_reference
from tolerances import REFERENCE, assert_close


def run(fn, h, w):
    h = h.detach().clone().requires_grad_(True)
    w = None if w is None else w.detach().clone().requires_grad_(True)
    y = fn(h, w)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y.dtype)
    (y * g).sum().backward()
    return y.detach(), h.grad, None if w is None else w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,F,weighted", [
    (37, 12, True),  # the experts' case: one combine weight per row
    (37, 12, False),  # no weights (a dispatcher that does not fold them)
    (5, 1, True),  # F=1: gate and up are single columns
    (0, 8, True),  # no rows at all (an empty micro-batch on this rank)
])
def test_weighted_swiglu_matches_reference(dtype, R, F, weighted) -> None:
    gen = torch.Generator().manual_seed(0)
    h = (2 * torch.randn(R, 2 * F, generator=gen)).to(dtype)
    w = torch.rand(R, generator=gen) if weighted else None  # fp32, as the router gives them
    if weighted and R:
        w[0] = 0.0  # a padding row: zero weight, zero gradient into h
    fast = run(weighted_swiglu, h, w)
    ref = run(weighted_swiglu_reference, h, w)
    # dw[r] = sum_f g[r, f] * silu(gate) * up: a sum with cancellation whose bf16 products are
    # rounded differently on the two sides, so its error follows the sum of |terms| (tolerances.py)
    g = torch.randn(R, F, generator=torch.Generator().manual_seed(3)).to(dtype)
    dw_terms = (g.float() * weighted_swiglu_reference(h).float()).abs().sum(-1)
    for a, b, name in zip(fast, ref, ("y", "dh", "dw")):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype, name
        assert_close(a.float(), b.float(), tol=REFERENCE[dtype], msg=name,
                     terms=dw_terms if name == "dw" else None)
    if weighted and R:
        assert torch.count_nonzero(fast[1][0]) == 0


def test_weighted_swiglu_is_deterministic() -> None:
    h, w = torch.randn(64, 16), torch.rand(64)
    a, b = run(weighted_swiglu, h, w), run(weighted_swiglu, h, w)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_weighted_swiglu_result_does_not_depend_on_row_position() -> None:
    # The EP dispatcher runs the same rows inside differently sized buffers and must match one device
    # bit for bit, so a row's result may not depend on where it sits. CPU silu on contiguous memory
    # rounds its vectorised body and its scalar tail differently; the fast path avoids that.
    from dropless.ops.activations import weighted_swiglu

    torch.manual_seed(0)
    h = torch.randn(1000, 14, requires_grad=True)
    w = torch.rand(1000, requires_grad=True)
    g = torch.randn(1000, 7)
    y = weighted_swiglu(h, w)
    y.backward(g)
    whole = (y.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    parts = torch.cat([weighted_swiglu(h[:333], w[:333]), weighted_swiglu(h[333:], w[333:])])
    parts.backward(g)
    for a, b in zip(whole, (parts.detach(), h.grad, w.grad)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind,clamp", [("swiglu", None), ("swiglu", 10.0), ("geglu", None), ("relu2", None)])
def test_dense_mlp_fast_path_matches_generic_activation(kind, clamp) -> None:
    # MLP takes weighted_swiglu for plain SwiGLU (any leading dims: the model's dense layers get
    # [B, S, D]); the generic activation is its reference, in output and every gradient.
    from dropless.layers.mlp import MLP
    from dropless.ops.activations import activation

    torch.manual_seed(0)
    mlp = MLP(12, 7, kind, clamp)
    x = torch.randn(2, 5, 12, requires_grad=True)
    g = torch.randn(2, 5, 12)

    def grads(forward):
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        y = forward(x)
        (y * g).sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in mlp.parameters()]

    fast = grads(mlp)
    ref = grads(lambda x: mlp.down(activation(mlp.gate_up(x), kind, clamp)))
    for a, b in zip(fast, ref):
        assert_close(a, b, REFERENCE[torch.float32])


@pytest.mark.parametrize("shape", [(0, 12), (2, 0, 12)])
def test_dense_mlp_fast_path_takes_no_tokens(shape) -> None:
    # a rank with no tokens still runs its shared experts (EP: every rank runs the same collectives)
    from dropless.layers.mlp import MLP

    mlp = MLP(12, 7, "swiglu")
    x = torch.randn(*shape, requires_grad=True)
    y = mlp(x)
    y.sum().backward()
    assert y.shape == shape and x.grad.shape == shape
    assert not mlp.gate_up.weight.grad.any()
