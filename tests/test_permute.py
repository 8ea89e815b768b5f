"""Routing plans: invariants (exact), alignment, capacity; permute and combine gradients."""

from __future__ import annotations

import pytest
import torch

from dropless.ops import permute as P
from dropless.ops.capacity_plan import make_capacity_plan


def random_ids(T: int, E: int, K: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


@pytest.mark.parametrize("T,E,K,align", [(17, 5, 2, 1), (17, 5, 2, 8), (1, 7, 7, 1), (3, 4, 2, 16),
                                         (40, 7, 1, 4), (64, 13, 3, 32)])
def test_plan_invariants(T: int, E: int, K: int, align: int) -> None:
    ids = random_ids(T, E, K)
    plan = P.make_plan(ids, E, align)
    Pn = T * K
    # counts match, offsets are the cumulative (padded) counts, int32
    assert torch.equal(plan.counts_E, torch.bincount(ids.view(-1), minlength=E))
    padded = (plan.counts_E + align - 1) // align * align
    assert plan.offsets_E.dtype == torch.int32
    assert torch.equal(plan.offsets_E.long(), torch.cumsum(padded, 0))
    assert plan.num_rows >= int(plan.offsets_E[-1])
    # every pair sits in exactly one row, inside its expert's group
    assert torch.equal(torch.sort(plan.row_of_P).values, torch.unique(plan.row_of_P))
    assert torch.equal(plan.pair_of_R[plan.row_of_P], torch.arange(Pn))
    real = plan.pair_of_R < Pn
    assert int(real.sum()) == Pn
    ends = plan.offsets_E.long()
    starts = ends - padded
    e_of_P = ids.view(-1)
    assert bool((plan.row_of_P >= starts[e_of_P]).all() and (plan.row_of_P < ends[e_of_P]).all())
    # within an expert the pairs keep token order (stable sort)
    for e in range(E):
        pairs = plan.pair_of_R[starts[e]:ends[e]]
        pairs = pairs[pairs < Pn]
        assert torch.equal(pairs, torch.sort(pairs).values)


def test_permute_combine_round_trip_and_gradients() -> None:
    T, E, K, D = 11, 5, 3, 6
    ids = random_ids(T, E, K, seed=3)
    plan = P.make_plan(ids, E, align=4)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    x_RD = P.permute(x, plan)
    pad = plan.pair_of_R == T * K
    assert torch.count_nonzero(x_RD[pad]) == 0
    out = P.combine(x_RD, w, plan)
    assert torch.allclose(out, w.sum(1, keepdim=True) * x)
    torch.autograd.gradcheck(lambda x, w: P.combine(P.permute(x, plan) * 2.0, w, plan), (x, w))


def test_capacity_plan_drops_and_pads() -> None:
    # 6 tokens all on expert 0 with K=1, E=2, factor 1.0 -> C = 3: three kept, three dropped.
    ids = torch.zeros(6, 1, dtype=torch.long)
    w = torch.tensor([[0.1], [0.9], [0.5], [0.7], [0.2], [0.8]])
    plan = make_capacity_plan(ids, w, 2, 1.0, "position")
    assert plan.capacity == 3 and plan.num_rows == 6
    assert plan.keep_P.tolist() == [True, True, True, False, False, False]
    assert int(plan.pairs_dropped()) == 3
    by_score = make_capacity_plan(ids, w, 2, 1.0, "score")
    assert by_score.keep_P.tolist() == [False, True, False, True, False, True]
    # expert 1's rows are all padding
    assert bool((plan.pair_of_R[3:] == 6).all())


def test_capacity_big_enough_drops_nothing() -> None:
    ids = random_ids(20, 6, 2)
    plan = make_capacity_plan(ids, torch.rand(20, 2), 6, capacity_factor=3.0)
    assert int(plan.pairs_dropped()) == 0
    assert plan.capacity == 20  # ceil(3 * 20 * 2 / 6)


@pytest.mark.parametrize("align", [1, 4])  # unpadded (no zero row needed) and padded plans
def test_unpermute_of_weighted_rows_equals_combine(align: int) -> None:
    # The folded path: rows pre-multiplied by permute_weights, then an unweighted sum per token,
    # must equal the weighted combine, in output and in the gradients of the rows and the weights.
    T, E, K, D = 13, 5, 3, 6
    plan = P.make_plan(random_ids(T, E, K, seed=4), E, align)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(T, K, dtype=torch.float64, generator=g, requires_grad=True)
    y_RD = P.permute(x, plan) * 1.5
    folded = P.unpermute(y_RD * P.permute_weights(w, plan).unsqueeze(-1), plan)
    weighted = P.combine(y_RD, w, plan)
    assert torch.allclose(folded, weighted)
    gx_f, gw_f = torch.autograd.grad(folded.square().sum(), (x, w), retain_graph=True)
    gx_w, gw_w = torch.autograd.grad(weighted.square().sum(), (x, w))
    assert torch.allclose(gx_f, gx_w) and torch.allclose(gw_f, gw_w)
    # padding rows carry weight exactly zero
    w_R = P.permute_weights(w, plan)
    assert torch.count_nonzero(w_R[plan.pair_of_R == T * K]) == 0
    torch.autograd.gradcheck(lambda x, w: P.unpermute(P.permute(x, plan) * P.permute_weights(w, plan)
                                                      .unsqueeze(-1), plan), (x, w))


def test_unpermute_masks_dropped_pairs_of_a_capacity_plan() -> None:
    # Dropped pairs point at row 0 (another pair's row): they must count zero, with zero gradient.
    ids = torch.zeros(6, 1, dtype=torch.long)
    w = torch.tensor([[0.1], [0.9], [0.5], [0.7], [0.2], [0.8]], dtype=torch.float64, requires_grad=True)
    plan = make_capacity_plan(ids, w, 2, 1.0, "position")
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    folded = P.unpermute(P.permute(x, plan) * P.permute_weights(w, plan).unsqueeze(-1), plan)
    weighted = P.combine(P.permute(x, plan), w, plan)
    assert torch.allclose(folded, weighted)
    assert torch.count_nonzero(folded[3:]) == 0
    gx, gw = torch.autograd.grad(folded.sum(), (x, w))
    assert torch.count_nonzero(gx[3:]) == 0 and torch.count_nonzero(gw[3:]) == 0


def test_permute_gradient_of_dropped_pairs_is_zero() -> None:
    # Regression: a dropped pair's row_of_P points at row 0, so permute's backward used to hand the
    # dropped token the gradient of whichever pair sits in row 0.
    ids = torch.zeros(6, 1, dtype=torch.long)
    plan = make_capacity_plan(ids, torch.rand(6, 1), 2, 1.0, "position")
    x = torch.randn(6, 4, requires_grad=True)
    P.permute(x, plan).sum().backward()
    assert torch.equal(x.grad, torch.cat([torch.ones(3, 4), torch.zeros(3, 4)]))


@pytest.mark.parametrize("N,bins,high", [
    (200, 7, 9),  # keys past the last bin are not counted (masked pairs use key = E)
    (50, 64, 64),  # more bins than most keys touch: empty bins
    (30, 3, 1),  # every key in bin 0
    (0, 5, 5),  # no keys
])
def test_bin_counts_equal_bincount(N, bins, high) -> None:
    # the sync-free count (sort + binary search) used by plans and the aux loss
    from dropless.ops.permute import bin_counts

    keys = torch.randint(0, high, (N,), generator=torch.Generator().manual_seed(N))
    assert torch.equal(bin_counts(keys, bins), torch.bincount(keys, minlength=bins + high)[:bins])
    assert bin_counts(keys, bins).dtype == torch.int64


def test_expert_out_sq_matches_loop_and_ignores_the_tail() -> None:
    from dropless.layers.moe import expert_out_sq

    gen = torch.Generator().manual_seed(0)
    ends = torch.tensor([3, 3, 7, 12], dtype=torch.int32)  # expert 1 empty
    y = torch.randn(15, 4, generator=gen)
    y[12:] = float("nan")  # past the last group end: uninitialised GEMM rows
    w = torch.rand(15, generator=gen)
    w[5] = 0.0  # a padding row: weight 0, counts zero
    got = expert_out_sq(y, ends, w)
    starts = [0, 3, 3, 7]
    want = torch.stack([sum(((y[r] / w[r]).square().mean() if w[r] != 0 else torch.tensor(0.0))
                            for r in range(s, int(e))) if int(e) > s else torch.tensor(0.0)
                        for s, e in zip(starts, ends)])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
