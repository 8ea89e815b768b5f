"""The uniform plan (ops/permute.py `make_plan(uniform_limit=...)`, ops/grouped_gemm.py
`uniform_limit`): on the CPU, bf16 GEMMs over nearly even groups of a few hundred rows each pad every
group to the largest one's size, so the experts run batched matmuls. Still dropless (the largest
group fits); the same rows in the same order inside each group, the rest padding. Index tensors are
compared exactly; the layer against the ragged plan at the bf16 tolerance (other GEMM kernels)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dropless.layers.dispatch import LocalDispatcher
from dropless.layers.moe import MoELayer
from dropless.moe_config import MoEConfig
from dropless.ops import grouped_gemm
from dropless.ops import permute as P
from tolerances import REFERENCE, assert_close

ALIGN = 32


def ids_with_counts(counts: list[int], K: int) -> torch.Tensor:
    """[T, K] expert ids with exactly `counts[e]` pairs on expert e, no token holding an expert twice
    (round-robin over the pairs sorted by expert: needs every count <= T), shuffled over tokens."""
    flat = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    T = flat.numel() // K
    ids = flat.view(K, T).t().contiguous()  # pair (t, j) = flat[j*T + t]: distinct per row when c <= T
    return ids[torch.randperm(T, generator=torch.Generator().manual_seed(0))]


def check_uniform(plan: P.RoutingPlan, ragged: P.RoutingPlan, counts: list[int]) -> None:
    E, C = len(counts), plan.capacity
    Pn = plan.num_tokens * plan.top_k
    assert C == max(-(-c // ALIGN) * ALIGN for c in counts)
    assert plan.num_rows == E * C and plan.keep_P is None and plan.pairs_dropped() is None
    assert torch.equal(plan.offsets_E, torch.arange(1, E + 1, dtype=torch.int32) * C)
    assert torch.equal(plan.counts_E, ragged.counts_E)
    starts = [0, *ragged.offsets_E.tolist()[:-1]]
    for e, c in enumerate(counts):  # the ragged group's pairs, in order, then padding
        assert torch.equal(plan.pair_of_R[e * C:e * C + c], ragged.pair_of_R[starts[e]:starts[e] + c]), e
        assert bool((plan.pair_of_R[e * C + c:(e + 1) * C] == Pn).all()), e
    real = torch.arange(Pn) if plan.valid_P is None else torch.arange(Pn)[plan.valid_P]
    assert torch.equal(plan.pair_of_R[plan.row_of_P[real]], real)


# why each case exists: (counts per expert, K, the limit, uniform?)
CASES = {
    "even_prime_E": ([128] * 5, 2, 1.25, True),  # prime E, every group one size: no padding at all
    "uneven_within": ([300, 250, 320, 290], 2, 1.25, True),  # 4 x 320 rows against 1184 aligned
    "empty_expert": ([400, 400, 448, 0], 2, 1.75, True),  # E*C 1792 / 1248 = 1.44: the empty group all padding
    "empty_expert_low_limit": ([400, 400, 448, 0], 2, 1.25, False),
    "all_on_one": ([512, 0, 0, 0], 1, 1.75, False),  # E*C = E x the rows: stays ragged
    "k_equals_e": ([300] * 3, 3, 1.25, True),  # every token on every expert
}


@pytest.mark.parametrize("case", list(CASES))
def test_uniform_plan_holds_the_ragged_groups(case: str) -> None:
    counts, K, limit, uniform = CASES[case]
    ids = ids_with_counts(counts, K)
    ragged = P.make_plan(ids, len(counts), ALIGN)
    plan = P.make_plan(ids, len(counts), ALIGN, uniform_limit=limit)
    if uniform:
        check_uniform(plan, ragged, counts)
    else:  # the ragged plan, field for field
        assert plan.capacity is None and plan.num_rows == ragged.num_rows
        for name in ("counts_E", "offsets_E", "row_of_P", "pair_of_R"):
            assert torch.equal(getattr(plan, name), getattr(ragged, name)), name
    # permute then unpermute gives each token the sum of its K rows, as on the ragged plan
    x = torch.randn(ids.shape[0], 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(P.unpermute(P.permute(x, plan), plan), P.unpermute(P.permute(x, ragged), ragged))


@pytest.mark.parametrize("limit, uniform", [(1.75, True), (1.0, False)])
def test_uniform_masked_plan_holds_the_valid_pairs(limit: float, uniform: bool) -> None:
    """Invalid pairs (identity experts, expert choice) get no row on either plan: the uniform one
    holds each group's valid pairs in the ragged one's order, the invalid pairs point at row 0."""
    counts = [300, 250, 320, 290]
    ids = ids_with_counts(counts, 2)
    valid = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) > 0.2
    ragged = P.make_plan(ids, 4, ALIGN, valid)
    plan = P.make_plan(ids, 4, ALIGN, valid, uniform_limit=limit)
    valid_counts = [int(((ids == e) & valid).sum()) for e in range(4)]
    if not uniform:
        assert plan.capacity is None
        for name in ("offsets_E", "row_of_P", "pair_of_R"):
            assert torch.equal(getattr(plan, name), getattr(ragged, name)), name
        return
    check_uniform(plan, ragged, valid_counts)
    invalid = ~valid.reshape(-1)
    assert bool((plan.row_of_P[invalid] == 0).all())
    assert torch.equal(plan.valid_P, ragged.valid_P) and plan.num_rows == 4 * plan.capacity


def test_uniform_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert grouped_gemm.uniform_limit(x, 1) is None  # no row bucket (fp32, GPU, small groups): ragged
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert grouped_gemm.uniform_limit(x, ALIGN) == 1.25
        torch.set_num_threads(2)
        assert grouped_gemm.uniform_limit(x, ALIGN) == 1.75
    finally:
        torch.set_num_threads(threads)
    with FakeTensorMode():  # the planner's fake tensors: no counts to read, so ragged
        assert grouped_gemm.uniform_limit(torch.zeros(4, 8, dtype=torch.bfloat16), ALIGN) is None


# T*K/E = 512 rows per group: above the row bucket's floor; the init router splits them evenly enough
T, D, E, K, F = 1024, 32, 4, 2, 16


def run(layer: MoELayer, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
        ) -> tuple[list[torch.Tensor], int | None]:
    """Output and gradients of one bf16 forward + backward, and the capacity of the plan it made."""
    plans = []
    make = LocalDispatcher.plan
    monkeypatch.setattr(LocalDispatcher, "plan", lambda *a, **k: plans.append(make(*a, **k)) or plans[-1])
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    g = torch.randn(out.y.shape, generator=torch.Generator().manual_seed(7))
    (out.y.float() * g).sum().backward()
    assert len(plans) == 1
    return [out.y.detach().float(), x.grad, *(p.grad for p in layer.parameters())], plans[0].capacity


@pytest.mark.parametrize("identity", [0, 1])
@pytest.mark.parametrize("lean", [True, False])
def test_uniform_layer_computes_the_ragged_layer(lean: bool, identity: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 layer on the uniform plan (batched matmuls) against the same layer on the ragged
    bucketed plan (a matmul per group): output and every gradient at the bf16 tolerance. With an
    identity expert the plans are masked (its pairs get no row)."""
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(num_experts=E, top_k=K, d_expert=F, n_identity_experts=identity))
    layer.experts.lean = lean
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(grouped_gemm, "UNIFORM_LIMIT", {})
    monkeypatch.setattr(grouped_gemm, "UNIFORM_LIMIT_THREADED", 2.0)
    uniform, C = run(layer, x, monkeypatch)
    assert C is not None and C % ALIGN == 0
    monkeypatch.setattr(grouped_gemm, "UNIFORM_LIMIT_THREADED", 0.0)
    ragged, C0 = run(layer, x, monkeypatch)
    assert C0 is None
    names = ["y", "dx", *(n for n, _ in layer.named_parameters())]
    for a, b, name in zip(uniform, ragged, names):
        # the weight gradients sum T*K/E rows: their rounding follows the sum of |terms|
        terms = b.abs().max() * torch.ones_like(b) if name.startswith("experts") else None
        assert_close(a.float(), b.float(), REFERENCE[torch.bfloat16], name, terms=terms)
