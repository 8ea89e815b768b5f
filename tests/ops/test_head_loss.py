"""The chunked head cross-entropy (ops/head_loss.py) against the plain one: the loss and the
gradients of x and of the head's weight, with ignored targets, a last chunk shorter than the others,
fp32 and bf16 autocast; and what it keeps: no [N, V] tensor among the saved ones."""

from __future__ import annotations

import pytest
import torch

from dropless.layers.doc_mask import IGNORE_INDEX
from dropless.ops import head_loss as hl
from dropless.saved_bytes import saved_bytes
from tests.tolerances import BF16_VS_FP32, REFERENCE, assert_close


def test_ignore_value_is_the_models() -> None:
    assert hl.IGNORE == IGNORE_INDEX


def case(N: int = 37, D: int = 24, V: int = 50):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.3
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = IGNORE_INDEX  # chat masks, other documents' targets
    return x, w, t


def grads(fn, x0, w0, t, autocast: bool = False):
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = fn(x, w, t)
    loss.backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
def test_chunked_equals_reference_fp32(chunk: int) -> None:
    x, w, t = case()
    got = grads(lambda x, w, t: hl.head_loss(x, w, t, chunk), x, w, t)
    ref = grads(hl.head_loss_reference, x, w, t)
    for a, b, name in zip(got, ref, ("loss", "grad x", "grad w")):
        assert_close(a, b, REFERENCE[torch.float32], msg=name)
    assert torch.count_nonzero(got[1][::5]) == 0  # ignored tokens send nothing back


def test_chunked_under_bf16_autocast() -> None:
    x, w, t = case()
    got = grads(lambda x, w, t: hl.head_loss(x, w, t, 8), x, w, t, autocast=True)
    ref = grads(hl.head_loss_reference, x, w, t, autocast=True)
    # grad w sums N products with cancellation; the reference rounds its one bf16 GEMM, the chunked
    # path sums fp32 products: the bound is taken on the sum of |terms| (tolerances.py REFERENCE)
    xb, wb = x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float()
    p = torch.softmax(xb @ wb.t(), dim=-1)
    keep = t != IGNORE_INDEX
    p[torch.arange(len(t)), t.clamp_min(0)] -= keep.float()
    terms_w = (p * keep.float().unsqueeze(-1)).abs().t() @ xb.abs()
    for a, b, name in zip(got, ref, ("loss", "grad x", "grad w")):
        assert a.dtype == b.dtype, name
        assert_close(a.float(), b.float(), REFERENCE[torch.bfloat16], msg=name,
                     terms=terms_w if name == "grad w" else None)
    assert_close(got[0], grads(hl.head_loss_reference, x, w, t)[0], BF16_VS_FP32)


def test_frozen_head_gets_no_gradient_and_no_logits_are_kept() -> None:
    x, w, t = case(N=64, D=16, V=300)
    xg = x.clone().requires_grad_(True)
    hl.head_loss(xg, w, t, 16).backward()
    assert xg.grad is not None and w.grad is None
    count = saved_bytes(lambda x: hl.head_loss(x, w, t, 16), x.clone().requires_grad_(True), exclude=[w])
    assert all(n < 64 * 300 for _, _, n in count.items), count.items
    ref = saved_bytes(lambda x: hl.head_loss_reference(x, w, t), x.clone().requires_grad_(True), exclude=[w])
    assert any(n >= 64 * 300 * 4 for _, _, n in ref.items)  # the plain one keeps [N, V] (the check's negative)
