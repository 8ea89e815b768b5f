"""Routing ops: scores, top-k, group limits, bias for selection only, weights, losses."""

from __future__ import annotations

import math

import pytest
import torch

from dropless.ops import routing
from tolerances import REFERENCE, assert_close


def test_score_functions() -> None:
    logits = torch.tensor([[0.0, 1.0, -2.0]])
    assert torch.allclose(routing.score_fn(logits, "softmax"), torch.softmax(logits, -1))
    assert torch.allclose(routing.score_fn(logits, "sigmoid"), 1 / (1 + torch.exp(-logits)))
    expected = torch.tensor([[math.sqrt(math.log1p(math.exp(v))) for v in (0.0, 1.0, -2.0)]])
    assert torch.allclose(routing.score_fn(logits, "sqrt_softplus"), expected)
    with pytest.raises(ValueError, match="score_func='tanh'"):
        routing.score_fn(logits, "tanh")


def test_topk_picks_best_and_renormalises() -> None:
    logits = torch.tensor([[0.1, 2.0, 1.0, -1.0]])
    ids, w, scores = routing.topk_route(logits, top_k=2)
    assert ids.tolist() == [[1, 2]]
    p = torch.softmax(logits, -1)[0]
    assert torch.allclose(w, torch.stack([p[1], p[2]]).unsqueeze(0) / (p[1] + p[2]))
    _, w_raw, _ = routing.topk_route(logits, top_k=2, renormalize=False, scaling_factor=2.5)
    assert torch.allclose(w_raw, 2.5 * torch.stack([p[1], p[2]]).unsqueeze(0))


def test_post_softmax_normalises_over_the_k_logits() -> None:
    logits = torch.tensor([[0.1, 2.0, 1.0, -1.0]])
    _, w, _ = routing.topk_route(logits, top_k=2, pre_softmax=False)
    assert torch.allclose(w, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))


def test_bias_changes_selection_not_weights() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    bias = torch.tensor([10.0, 0.0, 0.0])
    ids, w, scores = routing.topk_route(logits, top_k=1, bias_E=bias, renormalize=False)
    assert ids.tolist() == [[0]]
    # weight is expert 0's unbiased softmax probability, not anything the bias produced
    assert torch.allclose(w, torch.softmax(logits, -1)[:, :1])


def test_group_limited_routing() -> None:
    # 4 groups of 2 experts. Group scores (sum of top-2): g0=0.2, g1=1.7, g2=1.0, g3=0.9.
    # topk_groups=2 keeps g1 and g2, so expert 6 (score 0.8, best outside them) is ineligible.
    scores = torch.tensor([[0.1, 0.1, 0.9, 0.8, 0.5, 0.5, 0.85, 0.05]])
    masked = routing.group_limited_mask(scores, n_groups=4, topk_groups=2)
    assert torch.isinf(masked[0, [0, 1, 6, 7]]).all()
    assert torch.equal(masked[0, 2:6], scores[0, 2:6])
    ids, _, _ = routing.topk_route(torch.log(scores), top_k=3, score_func="softmax",
                                   n_groups=4, topk_groups=2)
    assert sorted(ids[0].tolist()) == [2, 3, 4]


def test_z_loss_and_aux_loss_values() -> None:
    logits = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    lse = torch.logsumexp(logits, -1)
    assert torch.allclose(routing.z_loss(logits), (lse ** 2).mean())
    probs = torch.softmax(logits, -1)
    counts = torch.tensor([2, 0])
    aux = routing.switch_aux_loss(probs, counts, top_k=1)
    assert torch.allclose(aux, 2 * (1.0 * probs[:, 0].mean() + 0.0))
    # perfectly balanced counts and flat probabilities give 1.0
    flat = torch.full((4, 4), 0.25)
    assert torch.allclose(routing.switch_aux_loss(flat, torch.tensor([1, 1, 1, 1]), 1), torch.tensor(1.0))


def test_aux_loss_gradient_flows_only_through_probabilities() -> None:
    logits = torch.randn(8, 4, requires_grad=True)
    ids, _, scores = routing.topk_route(logits, top_k=2)
    aux = routing.switch_aux_loss(scores, routing.expert_counts(ids, 4), 2)
    aux.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_router_probs_for_sigmoid_sum_to_one() -> None:
    s = torch.sigmoid(torch.randn(5, 6))
    assert torch.allclose(routing.router_probs(s, "sigmoid").sum(-1), torch.ones(5))


def test_replayed_ids_take_current_weights() -> None:
    logits = torch.randn(6, 5, requires_grad=True)
    ids, w, _ = routing.topk_route(logits, top_k=2, scaling_factor=1.5)
    w2, _ = routing.weights_at(logits, ids, scaling_factor=1.5)
    assert torch.equal(w, w2)
    forced = torch.tensor([[4, 0]] * 6)
    w3, _ = routing.weights_at(logits, forced)
    p = torch.softmax(logits, -1)
    assert torch.allclose(w3[:, 0], p[:, 4] / (p[:, 4] + p[:, 0]))
    w3.sum().backward()
    assert logits.grad is not None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pre_softmax", [True, False])
def test_renormalised_softmax_weights_match_the_quotient(dtype: torch.dtype, pre_softmax: bool) -> None:
    # The weights of a softmax router with renormalisation (and post-softmax's) are computed as the
    # softmax of the chosen logits (module note); the specification is the quotient of the gathered
    # full-softmax scores. Values and the logits' gradient, through the chosen ids and the others.
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(40, 7, generator=g, dtype=dtype)).requires_grad_(True)
    ids, w, _ = routing.topk_route(logits, top_k=3, pre_softmax=pre_softmax, scaling_factor=2.5)
    p = torch.softmax(logits, -1).gather(1, ids)
    ref = 2.5 * p / p.sum(-1, keepdim=True)
    probe = torch.randn(40, 3, generator=g, dtype=dtype)
    (grad,) = torch.autograd.grad((w * probe).sum(), logits, retain_graph=True)
    (grad_ref,) = torch.autograd.grad((ref * probe).sum(), logits)
    assert_close(w, ref, REFERENCE[dtype], msg="weights")
    assert_close(grad, grad_ref, REFERENCE[dtype], msg="logits gradient")
    # the logits outside the chosen ids get an exact zero (the quotient's is zero only in exact arithmetic)
    outside = torch.ones_like(logits, dtype=torch.bool).scatter_(1, ids, False)
    assert bool((grad[outside] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_aux_loss_matches_its_formula_in_value_and_gradient(dtype: torch.dtype) -> None:
    # switch_aux_loss is one dot product of P with the scaled counts; the specification is
    # E * sum_e f_e * P_e with f from the counts and P the mean probability.
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(24, 6, generator=g, dtype=dtype, requires_grad=True)
    ids, _, scores = routing.topk_route(logits, top_k=2)
    counts = routing.expert_counts(ids, 6)
    aux = routing.switch_aux_loss(scores, counts, 2)
    ref = 6 * (counts.to(dtype) / (24 * 2) * scores.mean(0)).sum()
    assert aux.dtype == dtype
    assert_close(aux, ref, REFERENCE[dtype], msg="aux loss")
    (grad,) = torch.autograd.grad(aux, logits, retain_graph=True)
    (grad_ref,) = torch.autograd.grad(ref, logits)
    assert_close(grad, grad_ref, REFERENCE[dtype], msg="logits gradient")
