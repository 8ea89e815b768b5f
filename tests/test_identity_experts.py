"""Identity (zero-compute) experts, `moe.n_identity_experts` (layers/identity.py): they pass their
input exactly (times the routing weight), cost no expert row, count in routing, balancing and the
monitor like any expert, and the layer matches the per-token loop reference (tests/reference_moe.py,
which runs an identity id as `w * x`) in its output and every gradient."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dropless.config import MoEConfig, RouterConfig
from dropless.layers import identity
from dropless.layers.moe import MoELayer
from dropless.ops import grouped_gemm
from dropless.model import MoEModel
from reference_moe import moe_reference
from test_moe_layer import build, check_against_reference
from test_model_knobs import B, S, check_against_reference as check_model, model_cfg, tokens
from tolerances import assert_close

E, Z = 4, 2


def layer(K: int = 2, **kw) -> MoELayer:
    return build(16, E=E, K=K, f=12, n_identity_experts=Z, **kw)


def test_identity_pairs_pass_their_input_exactly() -> None:
    # every pair forced onto an identity expert (the replay path of the router): y is the summed
    # routing weight times x, bit for bit, and no expert row is computed
    moe = layer()
    x = torch.randn(10, 16)
    ids = torch.tensor([[E, E + 1]] * 10)
    out = moe(x, replay_ids=ids)
    w_TK = moe.router(x, ids).weights_TK
    assert torch.equal(out.y, w_TK.sum(-1, keepdim=True) * x)
    assert torch.equal(out.stats.tokens_per_expert_E, torch.tensor([0, 0, 0, 0, 10, 10]))
    # one real and one identity pair: the real expert's part plus w * x, against the loop reference
    ids = torch.tensor([[0, E], [3, E + 1]] * 5)
    y = moe(x, replay_ids=ids).y
    w_TK = moe.router(x, ids).weights_TK
    real = moe(x, replay_ids=torch.tensor([[0, 0], [3, 3]] * 5))  # the same expert twice: its row doubled
    w_real = moe.router(x, torch.tensor([[0, 0], [3, 3]] * 5)).weights_TK
    assert_close(y - w_TK[:, 1:] * x, real.y * (w_TK[:, :1] / w_real.sum(-1, keepdim=True)), msg="mixed")


def test_identity_experts_cost_no_expert_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = layer()
    seen = []
    real = type(moe.experts).forward
    monkeypatch.setattr(type(moe.experts), "forward", lambda self, b: (seen.append(b.offsets_E), real(self, b))[1])
    x = torch.randn(12, 16)
    out = moe(x)
    counts = out.stats.tokens_per_expert_E
    assert counts.shape == (E + Z,) and int(counts.sum()) == 12 * 2
    assert int(counts[E:].sum()) > 0, "seed routes nothing to an identity expert: the test says nothing"
    assert int(seen[0][-1]) == int(counts[:E].sum())  # rows computed = real pairs only
    assert torch.equal(seen[0].diff(prepend=seen[0].new_zeros(1)).long(), counts[:E])


@pytest.mark.parametrize("case", [dict(K=2), dict(K=1), dict(K=3), dict(K=2, n_shared_experts=1),
                                  dict(K=2, router=RouterConfig(score_func="sigmoid"))],
                         ids=["k2", "k1", "k3", "shared", "sigmoid"])
def test_identity_layer_against_reference(case: dict) -> None:
    torch.manual_seed(3)
    moe = layer(**case)
    check_against_reference(moe, torch.randn(2, 9, 16))


def test_all_identity_batch_has_no_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    # no real pair anywhere: the experts get no row; the selects keep padding garbage out of y and
    # of x's gradient. The grouped GEMMs leave rows past the last group end uninitialised (NaN or
    # not, by chance): they are made NaN here, so the test does not depend on what memory held.
    real = grouped_gemm.grouped_dgrad

    def garbage_tail(g_RF, w_EDF, offsets_E, backend="grouped_mm", group_rows=None):
        out = real(g_RF, w_EDF, offsets_E, backend, group_rows)
        out[int(offsets_E[-1]):] = float("nan")
        return out

    monkeypatch.setattr(grouped_gemm, "grouped_dgrad", garbage_tail)
    moe = layer(bias=[-1e4] * E + [0.0] * Z)
    x = torch.randn(6, 16, requires_grad=True)
    out = moe(x)
    assert int(out.stats.tokens_per_expert_E[:E].sum()) == 0
    out.y.sum().backward()
    assert torch.isfinite(out.y).all() and torch.isfinite(x.grad).all()
    assert torch.isfinite(moe.router.weight.grad).all()
    # a padding row the experts left uninitialised (the grouped_mm path on a GPU) may hold NaN: the
    # select drops it where a multiply by zero would not
    split = identity.split(moe.router(x.detach()), moe.slots)
    y = split.combine(torch.full((6, 16), float("nan")), x.detach())
    assert torch.equal(y, split.weight_T.unsqueeze(-1) * x.detach())


def test_identity_experts_in_balancing_and_monitor() -> None:
    moe = layer(router=RouterConfig(use_expert_bias=True))
    assert moe.router.expert_bias.shape == (E + Z,)
    moe.detailed_stats = True
    x = torch.randn(12, 16)
    out = moe(x)
    assert out.probs_mean_E.shape == (E + Z,)
    assert out.stats.out_sq_E.shape == (E + Z,)
    ids = out.ids_TK
    for z in range(Z):  # an identity expert's own output is x: its out_sq sums its tokens' mean(x^2)
        want = sum(float(x[t].square().mean()) for t in range(12) for k in range(2) if ids[t, k] == E + z)
        assert abs(float(out.stats.out_sq_E[E + z]) - want) < 1e-5


def test_identity_config_validation() -> None:
    with pytest.raises(ValueError, match=r"moe\.n_identity_experts=-1"):
        MoEConfig(n_identity_experts=-1)
    with pytest.raises(ValueError, match=r"moe\.n_identity_experts=2: needs the dropless path"):
        MoEConfig(n_identity_experts=2, capacity_factor=1.0)
    MoEConfig(num_experts=2, top_k=3, n_identity_experts=1)  # k may exceed E when identities fill it
    with pytest.raises(ValueError, match=r"moe\.top_k=4: exceeds num_experts=2 \+ n_identity_experts=1"):
        MoEConfig(num_experts=2, top_k=4, n_identity_experts=1)


@pytest.mark.parametrize("recompute", [[], ["layer"], ["moe"]], ids=lambda r: "+".join(r) or "none")
def test_identity_model_against_reference_and_recompute(recompute: list[str]) -> None:
    check_model(model_cfg("model.moe.n_identity_experts=2"), recompute)


def test_split_puts_every_identity_id_in_the_real_experts_range() -> None:
    # An invalid slot (expert-threshold and expert-choice strategies leave some) may hold an identity
    # id: the real experts' decision must still index only real experts, since tables indexed by
    # expert (the hot-replica placement, distributed/ep_replicas.py) read every slot's id.
    from dropless.expert_slots import ExpertSlots
    from dropless.layers.router import RoutingDecision

    slots = ExpertSlots(4, identity=2)
    ids = torch.tensor([[0, 5], [4, 1], [5, 4]])
    valid = torch.tensor([[True, False], [True, True], [False, True]])
    d = RoutingDecision(ids, torch.full((3, 2), 0.5), torch.zeros(3, 6), torch.zeros(3, 6), valid)
    split = identity.split(d, slots)
    assert int(split.experts.ids_TK.max()) < slots.routed
    assert split.experts.valid_TK.tolist() == [[True, False], [False, True], [False, False]]
    assert split.is_identity_TK.tolist() == [[False, False], [True, False], [False, True]]
