"""Routing strategies: each one's defining property, masked plans, and the layer against a
per-token loop reference for the variable-experts-per-token strategies."""

from __future__ import annotations

import math

import pytest
import torch

from dropless.config import MoEConfig, RouterConfig
from dropless.layers.dispatch import DispatchMeta, LocalDispatcher
from dropless.layers.moe import MoELayer
from dropless.layers.router import Router, RoutingDecision
from dropless.ops import permute as P
from dropless.ops import routing
from dropless.ops.capacity_plan import make_capacity_plan
from dropless.ops.activations import activation
from tolerances import assert_close


def layer_with(strategy: str, *, E: int = 6, K: int = 2, d: int = 16, seed: int = 0, **rkw) -> MoELayer:
    torch.manual_seed(seed)
    return MoELayer(d, MoEConfig(num_experts=E, top_k=K, d_expert=8,
                                 router=RouterConfig(strategy=strategy, **rkw)))


def loop_reference(layer: MoELayer, x_TD: torch.Tensor, decision) -> torch.Tensor:
    """Per-token loop over the decision's slots, skipping invalid ones."""
    ex = layer.experts
    valid = decision.valid_TK
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros_like(x_TD[t])
        for j in range(decision.ids_TK.shape[1]):
            if valid is not None and not bool(valid[t, j]):
                continue
            e = int(decision.ids_TK[t, j])
            h = activation(x_TD[t] @ ex.w_gate_up_EDF[e], ex.kind, ex.clamp, ex.softcap)
            acc = acc + decision.weights_TK[t, j] * (h @ ex.w_down_EFD[e])
        rows.append(acc)
    return torch.stack(rows)


def check_layer(layer: MoELayer, x: torch.Tensor, **fwd) -> None:
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    results = []
    for use_ref in (False, True):
        layer.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_(True)
        if use_ref:
            y = loop_reference(layer, xx, layer.router(xx, token_ids=fwd.get("token_ids")))
        else:
            y = layer(xx, **fwd).y
        (y * g).sum().backward()
        grads = {"x": xx.grad}
        grads.update({n: p.grad.clone() for n, p in layer.named_parameters()})
        results.append((y.detach(), grads))
    (y1, g1), (y2, g2) = results
    assert_close(y1, y2, msg="output")
    for n in g2:
        assert_close(g1[n], g2[n], msg=f"grad {n}")


# --- masked plans -----------------------------------------------------------------------------


@pytest.mark.parametrize("align", [1, 4])
def test_masked_plan_invariants_and_gradients(align: int) -> None:
    T, E, K, D = 9, 5, 3, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    valid = torch.rand(T, K, generator=g) < 0.6
    valid[0, 0] = True
    plan = P.make_plan(ids, E, align, valid)
    # counts and groups hold exactly the valid pairs
    assert torch.equal(plan.counts_E, routing.expert_counts(ids, E, valid))
    padded = (plan.counts_E + align - 1) // align * align
    assert torch.equal(plan.offsets_E.long(), torch.cumsum(padded, 0))
    real = plan.pair_of_R[plan.pair_of_R < T * K]
    assert torch.equal(torch.sort(real).values, torch.nonzero(valid.view(-1)).view(-1))
    v = valid.view(-1)
    assert torch.equal(plan.pair_of_R[plan.row_of_P[v]], torch.arange(T * K)[v])
    # round trip: combine(permute(x)) = (sum of valid weights) * x; gradients by gradcheck (fp64)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    out = P.combine(P.permute(x, plan), w, plan)
    assert torch.allclose(out, (w * valid).sum(1, keepdim=True) * x)
    torch.autograd.gradcheck(lambda x, w: P.combine(P.permute(x, plan) * 2.0, w, plan), (x, w))


def test_capacity_dropped_pair_gets_no_input_gradient() -> None:
    # A dropped pair points at row 0 for combine's gather; its token must not receive row 0's gradient.
    ids = torch.zeros(4, 1, dtype=torch.long)
    plan = make_capacity_plan(ids, torch.ones(4, 1), 2, 0.5, "position")  # C = 1: tokens 1..3 drop
    x = torch.randn(4, 3, requires_grad=True)
    P.permute(x, plan).sum().backward()
    assert torch.equal(x.grad[1:], torch.zeros(3, 3))
    assert torch.equal(x.grad[0], torch.ones(3))


@pytest.mark.parametrize("kind", ["dropless", "masked", "capacity"])
def test_local_dispatcher_contract(kind: str) -> None:
    # The experts get each row's routing weight (0 on padding, none for an invalid or dropped pair)
    # and combine is an unweighted sum of a token's rows: ones in every row give each token its
    # number of computed pairs. The metadata is the typed base with the whole expert range.
    T, E, K, D = 11, 5, 3, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    valid = torch.rand(T, K, generator=g) < 0.6 if kind == "masked" else None
    disp = LocalDispatcher(E, align=4, capacity_factor=0.5 if kind == "capacity" else None)
    dec = RoutingDecision(ids, w, torch.zeros(T, E), torch.zeros(T, E), valid)
    batch, meta = disp.dispatch(torch.randn(T, D, generator=g), dec)
    assert isinstance(meta, DispatchMeta) and (meta.first_expert, meta.num_local) == (0, E)
    mask = meta.plan.mask_P
    kept = torch.ones(T * K, dtype=torch.bool) if mask is None else mask
    if kind == "capacity":
        assert int(meta.pairs_dropped) == T * K - int(kept.sum())
    else:  # a dropless plan cannot drop: it computes no count of drops (a masked pair is no pair)
        assert meta.pairs_dropped is None
    want_R = torch.zeros(batch.x_RD.shape[0])
    want_R[meta.plan.row_of_P[kept]] = w.reshape(-1)[kept]
    assert torch.equal(batch.weights_R, want_R)
    y = disp.combine(torch.ones(batch.x_RD.shape[0], D), meta)
    assert torch.equal(y, kept.view(T, K).sum(1, keepdim=True).float().expand(T, D))
    if kind == "masked":
        with pytest.raises(ValueError, match="capacity baseline"):
            LocalDispatcher(E, capacity_factor=1.0).dispatch(torch.randn(T, D), dec)


# --- expert choice ------------------------------------------------------------------------------


@pytest.mark.parametrize("T,E,K,factor", [(24, 6, 2, 1.0), (13, 7, 3, 1.0), (10, 4, 1, 2.0), (3, 8, 2, 1.0)])
def test_expert_choice_gives_every_expert_its_capacity(T: int, E: int, K: int, factor: float) -> None:
    # (13, 7, 3): C = ceil(39/7) = 6 does not divide evenly; (3, 8, 2): C = 1 with fewer tokens than experts
    scores = torch.softmax(torch.randn(T, E, generator=torch.Generator().manual_seed(T)), -1)
    ids, w, valid = routing.expert_choice_route(scores, top_k=K, capacity_factor=factor)
    C = min(T, math.ceil(factor * T * K / E))
    assert torch.equal(routing.expert_counts(ids, E, valid), torch.full((E,), C))
    # each expert took its C best tokens
    for e in range(E):
        chosen = torch.nonzero(valid[:, e]).view(-1)
        assert torch.equal(torch.sort(chosen).values, torch.sort(scores[:, e].topk(C).indices).values)
    assert torch.equal(w, scores * valid)


def test_expert_choice_layer_matches_reference() -> None:
    layer = layer_with("expert_choice", E=5, K=2)
    check_layer(layer, torch.randn(17, 16))
    out = layer(torch.randn(17, 16))
    assert torch.equal(out.stats.tokens_per_expert_E, torch.full((5,), 7))  # ceil(34/5)


# --- expert threshold ----------------------------------------------------------------------------


def test_threshold_routing_is_causal_and_learns_from_past_batches() -> None:
    layer = layer_with("expert_threshold", E=6, K=2)
    r = layer.router
    g = torch.Generator().manual_seed(3)
    # before any update: token-choice top-k, exactly K valid slots
    x0 = torch.randn(64, 16, generator=g)
    d0 = r(x0)
    assert torch.equal(d0.valid_TK.sum(1), torch.full((64,), 2))
    ids_tc, _, _ = routing.topk_route(r.logits(x0), top_k=2)
    assert torch.equal(d0.ids_TK[:, :2], ids_tc)
    r.update_threshold(layer(x0).stats.score_quantile_E)
    assert bool(r.threshold_ready)
    torch.testing.assert_close(r.threshold_E, routing.score_quantile(d0.scores_TE, 2))
    # the defining property: changing later tokens does not change earlier tokens' routing
    x = torch.randn(32, 16, generator=g)
    x_changed = x.clone()
    x_changed[20:] = torch.randn(12, 16, generator=g) * 5
    a, b = r(x), r(x_changed)
    assert torch.equal(a.ids_TK[:20], b.ids_TK[:20]) and torch.equal(a.valid_TK[:20], b.valid_TK[:20])
    assert torch.equal(a.weights_TK[:20], b.weights_TK[:20])
    # variable experts per token, at least one each; a token takes exactly the experts over threshold
    n = a.valid_TK.sum(1)
    assert bool((n >= 1).all()) and int(n.max()) > int(n.min())
    over = a.scores_TE > r.threshold_E
    for t in range(32):
        chosen = set(a.ids_TK[t][a.valid_TK[t]].tolist())
        expected = set(torch.nonzero(over[t]).view(-1).tolist()) or {int((a.scores_TE[t] - r.threshold_E).argmax())}
        assert chosen == expected
    # EMA: the second update moves 1 - momentum of the way
    before = r.threshold_E.clone()
    q = routing.score_quantile(a.scores_TE, 2)
    r.update_threshold(q)
    torch.testing.assert_close(r.threshold_E, 0.99 * before + 0.01 * q)


def test_threshold_layer_matches_reference_with_a_slot_cap() -> None:
    layer = layer_with("expert_threshold", E=6, K=2, max_experts_per_token=3)
    x = torch.randn(20, 16)
    layer.router.update_threshold(layer(x).stats.score_quantile_E * 0.5)  # low thresholds: caps bite
    assert layer.router(x).ids_TK.shape == (20, 3)
    check_layer(layer, x)


# --- hash and forced balance ---------------------------------------------------------------------


def test_hash_same_token_id_same_experts() -> None:
    layer = layer_with("hash", E=8, K=2, hash_buckets=16)
    tok = torch.tensor([3, 5, 3, 19, 7, 5])
    d = layer.router(torch.randn(6, 16), token_ids=tok)
    assert torch.equal(d.ids_TK[0], d.ids_TK[2]) and torch.equal(d.ids_TK[1], d.ids_TK[5])
    assert torch.equal(d.ids_TK[3], d.ids_TK[0])  # 19 = 3 mod 16 buckets
    assert bool((d.ids_TK[:, 0] != d.ids_TK[:, 1]).all())  # distinct experts per token
    # different inputs, same ids: the router does not choose
    d2 = layer.router(torch.randn(6, 16), token_ids=tok)
    assert torch.equal(d.ids_TK, d2.ids_TK)
    check_layer(layer, torch.randn(6, 16), token_ids=tok)
    with pytest.raises(ValueError, match="token_ids"):
        layer.router(torch.randn(6, 16))


@pytest.mark.parametrize("T,E,K", [(10, 4, 2), (7, 5, 5), (33, 8, 3)])
def test_forced_balance_is_balanced_and_distinct(T: int, E: int, K: int) -> None:
    torch.manual_seed(0)
    ids = routing.forced_balance_ids(T, E, K)
    counts = routing.expert_counts(ids, E)
    assert int(counts.max() - counts.min()) <= 1 and int(counts.sum()) == T * K
    assert all(len(set(row)) == K for row in ids.tolist())
    layer = layer_with("forced_balance", E=E, K=K)
    out = layer(torch.randn(T, 16))
    assert int(out.stats.tokens_per_expert_E.max() - out.stats.tokens_per_expert_E.min()) <= 1
