"""Serving with fewer experts: `topk_route(top_k=K1, norm_top_k=K2)` runs the top K1 experts with
their weights normalised over the top K2 (ops/routing.py module note), and RouterConfig's checks.

The reference is a per-token Python loop written from the rule's statement (sort the selection
scores, take the eligible top K2, divide each kept score by the K2 mass), not from topk_route."""

from __future__ import annotations

import math

import pytest
import torch

from dropless.config import MoEConfig, RouterConfig
from dropless.ops import routing
from tolerances import assert_close


def reference_route(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, *, k1: int, k2: int | None,
                    score_func: str, pre_softmax: bool, renormalize: bool, scale: float,
                    n_groups: int = 1, topk_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = logits_TE.shape
    n = k1 if k2 is None else k2
    ids, weights = [], []
    for t in range(T):
        l = logits_TE[t]
        if score_func == "softmax":
            s = torch.exp(l) / torch.exp(l).sum()
        elif score_func == "sigmoid":
            s = 1 / (1 + torch.exp(-l))
        else:
            s = torch.sqrt(torch.log1p(torch.exp(l)))
        post = score_func == "softmax" and not pre_softmax
        sel = [float((l[e] if post else s[e]).detach()) + (float(bias_E[e]) if bias_E is not None else 0.0)
               for e in range(E)]
        eligible = list(range(E))
        if n_groups > 1:
            per = E // n_groups
            gscore = [sum(sorted(sel[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_groups)]
            groups = sorted(range(n_groups), key=lambda g: (-gscore[g], g))[:topk_groups]
            eligible = [e for e in eligible if e // per in groups]
        top = sorted(eligible, key=lambda e: (-sel[e], e))[:n]
        if post:
            w = [torch.exp(l[i]) / sum(torch.exp(l[j]) for j in top) for i in top[:k1]]
        elif renormalize and (n > 1 or k2 is not None):
            w = [s[i] / sum(s[j] for j in top) for i in top[:k1]]
        else:
            w = [s[i] for i in top[:k1]]
        ids.append(top[:k1])
        weights.append(torch.stack(w) * scale)
    return torch.tensor(ids), torch.stack(weights)


# (score_func, pre_softmax, renormalize): every way the weights are formed
RULES = [("softmax", True, True), ("softmax", False, True), ("softmax", True, False),
         ("sigmoid", True, True), ("sigmoid", True, False), ("sqrt_softplus", True, True)]
# (E, k1, k2, n_groups, topk_groups, bias) and why each exists
SHAPES = [
    (8, 1, 2, 1, 1, False),   # the serving case: top-1 of a top-2 model
    (8, 1, 4, 1, 1, True),    # K2 = 2k; a selection bias that must not enter the weights
    (8, 2, 2, 1, 1, False),   # K2 = K1 given explicitly: the plain rule
    (8, 1, 1, 1, 1, False),   # K2 = K1 = 1: an explicit norm_top_k normalises one weight to 1
    (7, 3, 7, 1, 1, False),   # prime E, K2 = E: the full mass
    (7, 7, 7, 1, 1, False),   # k = E
    (8, 2, 4, 4, 2, True),    # group-limited: K2 fills both eligible groups exactly
    (8, 1, 3, 4, 2, False),   # group-limited, K2 inside the eligible set
]


@pytest.mark.parametrize("score_func,pre_softmax,renormalize", RULES)
@pytest.mark.parametrize("E,k1,k2,n_groups,topk_groups,use_bias", SHAPES)
def test_mass_weights_match_reference(score_func: str, pre_softmax: bool, renormalize: bool, E: int,
                                      k1: int, k2: int, n_groups: int, topk_groups: int,
                                      use_bias: bool) -> None:
    g = torch.Generator().manual_seed(E * 100 + k1 * 10 + k2)
    logits = torch.randn(13, E, generator=g, dtype=torch.float32).requires_grad_(True)
    bias = 0.1 * torch.randn(E, generator=g) if use_bias else None
    coef = torch.randn(13, k1, generator=g)
    kw = dict(score_func=score_func, pre_softmax=pre_softmax, renormalize=renormalize,
              n_groups=n_groups, topk_groups=topk_groups)
    ids, w, _ = routing.topk_route(logits, top_k=k1, norm_top_k=k2, scaling_factor=2.5, bias_E=bias, **kw)
    (gw,) = torch.autograd.grad((w * coef).sum(), logits)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_ids, ref_w = reference_route(ref_logits, bias, k1=k1, k2=k2, scale=2.5, **kw)
    (gref,) = torch.autograd.grad((ref_w * coef).sum(), ref_logits)
    assert torch.equal(ids, ref_ids)
    assert ids.is_contiguous() and w.is_contiguous()
    assert_close(w, ref_w, msg="weights")
    assert_close(gw, gref, msg="d loss / d logits")


def test_hand_computed_weights() -> None:
    """Top-1 of [2, 1, 0.5, -1] over the mass of the top 2: p0 / (p0 + p1) = 1 / (1 + e^-1)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    e = [math.exp(v) for v in (2.0, 1.0, 0.5, -1.0)]
    for pre in (True, False):  # post-softmax over the top-2 logits is the same quantity
        _, w, _ = routing.topk_route(logits, top_k=1, norm_top_k=2, pre_softmax=pre)
        assert w.item() == pytest.approx(1 / (1 + math.exp(-1)), rel=1e-6)
    _, w, _ = routing.topk_route(logits, top_k=1, norm_top_k=4)
    assert w.item() == pytest.approx(e[0] / sum(e), rel=1e-6)  # the full softmax probability
    _, w, _ = routing.topk_route(logits, top_k=1, norm_top_k=1, scaling_factor=2.5)
    assert w.item() == 2.5  # renormalised by the one kept expert
    _, w, _ = routing.topk_route(logits, top_k=1)
    assert w.item() == pytest.approx(e[0] / sum(e), rel=1e-6)  # plain top-1 keeps p (not renormalised)
    _, w, _ = routing.topk_route(logits, top_k=2, norm_top_k=3, score_func="sigmoid", scaling_factor=2.0)
    s = [1 / (1 + math.exp(-v)) for v in (2.0, 1.0, 0.5)]
    assert w[0].tolist() == pytest.approx([2 * s[0] / sum(s), 2 * s[1] / sum(s)], rel=1e-6)


@pytest.mark.parametrize("score_func,pre_softmax,renormalize", RULES)
def test_k2_equal_k_is_bit_identical(score_func: str, pre_softmax: bool, renormalize: bool) -> None:
    """norm_top_k = top_k (k >= 2) runs the same ops as the trained rule: the same bits, and the K1
    slots of a K2 routing are the first K1 slots of the plain top-K2 routing, bit for bit."""
    logits = torch.randn(33, 8, generator=torch.Generator().manual_seed(1))
    kw = dict(score_func=score_func, pre_softmax=pre_softmax, renormalize=renormalize)
    ids, w, s = routing.topk_route(logits, top_k=3, **kw)
    ids2, w2, s2 = routing.topk_route(logits, top_k=3, norm_top_k=3, **kw)
    assert torch.equal(ids, ids2) and torch.equal(w, w2) and torch.equal(s, s2)
    ids5, w5, _ = routing.topk_route(logits, top_k=5, **kw)
    ids35, w35, _ = routing.topk_route(logits, top_k=3, norm_top_k=5, **kw)
    assert torch.equal(ids35, ids5[:, :3]) and torch.equal(w35, w5[:, :3])


def test_larger_k2_shrinks_the_kept_weights() -> None:
    """The seeds' point: renormalising by the kept experts alone inflates their weights; the K2 mass
    keeps them at (K2 = k) or below their trained values."""
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    sums = [routing.topk_route(logits, top_k=4, norm_top_k=k2)[1].sum(-1) for k2 in (4, 8, 16)]
    assert torch.allclose(sums[0], torch.ones(64))
    assert (sums[1] < sums[0]).all() and (sums[2] < sums[1]).all()
    trained = routing.topk_route(logits, top_k=8)[1]
    assert torch.equal(routing.topk_route(logits, top_k=4, norm_top_k=8)[1], trained[:, :4])


@pytest.mark.parametrize("router,top_k,match", [
    (RouterConfig(norm_top_k=1), 2, r"norm_top_k=1: is below moe\.top_k=2"),
    (RouterConfig(norm_top_k=9), 2, r"norm_top_k=9: exceeds moe\.num_experts=8"),
    (RouterConfig(norm_top_k=0), 1, r"norm_top_k=0"),
    (RouterConfig(norm_top_k=5, n_groups=4, topk_groups=2), 2, r"norm_top_k=5: exceeds the 4 experts"),
    (RouterConfig(norm_top_k=4, strategy="hash"), 2, r"norm_top_k=4: only acts with moe\.router\.strategy='token_choice'"),
    (RouterConfig(norm_top_k=4, strategy="expert_choice"), 2, r"norm_top_k=4: only acts"),
    (RouterConfig(norm_top_k=4, renormalize=False), 2, r"norm_top_k=4: needs normalised weights"),
    (RouterConfig(norm_top_k=4, score_func="sigmoid", renormalize=False), 2, r"norm_top_k=4: needs normalised weights.*raw sigmoid scores"),
    (RouterConfig(pre_softmax=False), 1, r"pre_softmax=False"),  # plain post-softmax top-1: still refused
])
def test_config_refuses(router: RouterConfig, top_k: int, match: str) -> None:
    with pytest.raises(ValueError, match=r"moe\.router\." + match):
        MoEConfig(num_experts=8, top_k=top_k, router=router)


def test_config_accepts() -> None:
    # post-softmax top-1 over a K2 >= 2 mass is a real softmax (weight < 1, router gradient)
    MoEConfig(num_experts=8, top_k=1, router=RouterConfig(pre_softmax=False, norm_top_k=2))
    # post-softmax needs no renormalize flag: it always normalises over the K2 logits
    MoEConfig(num_experts=8, top_k=1, router=RouterConfig(pre_softmax=False, renormalize=False, norm_top_k=2))
    MoEConfig(num_experts=8, top_k=8, router=RouterConfig(norm_top_k=8))
    # an explicit norm_top_k=1 is the serving "kept" rule at one expert (weight 1), pre or post
    MoEConfig(num_experts=8, top_k=1, router=RouterConfig(norm_top_k=1))
    MoEConfig(num_experts=8, top_k=1, router=RouterConfig(norm_top_k=1, pre_softmax=False))
