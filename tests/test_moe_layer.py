"""The MoE layer against the per-token loop reference: outputs and every gradient, on the shapes
that break kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dropless.config import MoEConfig, RouterConfig
from dropless.layers.mlp import MLP
from dropless.layers.moe import MoELayer
from dropless.ops.activations import activation
from host_sync import forbid_host_sync
from reference_moe import moe_reference
from scatter_add_check import record_colliding_accumulations
from tolerances import BF16_VS_FP32, DENSE_EQUIV, assert_close


def build(d: int = 16, *, E: int = 8, K: int = 2, f: int = 12, bias: list[float] | None = None,
          seed: int = 0, **kw) -> MoELayer:
    router = kw.pop("router", RouterConfig(use_expert_bias=bias is not None))
    cfg = MoEConfig(num_experts=E, top_k=K, d_expert=f, router=router, **kw)
    torch.manual_seed(seed)
    layer = MoELayer(d, cfg)
    if bias is not None:
        layer.router.expert_bias.copy_(torch.tensor(bias))
    return layer


def grads(layer: MoELayer, x: torch.Tensor, fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    (y * g).sum().backward()
    out = {"x": x.grad}
    out.update({n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    return y.detach(), out


def check_against_reference(layer: MoELayer, x: torch.Tensor) -> None:
    y_fast, g_fast = grads(layer, x, lambda x: layer(x).y)
    y_ref, g_ref = grads(layer, x, lambda x: moe_reference(layer, x))
    assert_close(y_fast, y_ref, msg="output")
    assert g_fast.keys() == g_ref.keys()
    for name in g_ref:
        assert_close(g_fast[name], g_ref[name], msg=f"grad {name}")


CASES = {
    # the default shape: several tokens per expert, k > 1
    "basic": dict(T=24, d=16, E=8, K=2, f=12),
    # E prime: no power-of-two assumptions in offsets or group sizes
    "prime_E": dict(T=30, d=16, E=7, K=3, f=12),
    # odd widths: grouped_mm needs 16-byte strides, so d and f are padded internally
    "odd_widths": dict(T=20, d=13, E=5, K=2, f=7),
    # k=1: the top-1 path (pre-softmax is required for softmax)
    "k1": dict(T=20, d=16, E=6, K=1, f=8),
    # k=E: every token visits every expert; no expert is ever empty
    "k_eq_E": dict(T=10, d=16, E=4, K=4, f=8),
    # T=1: a single token (decode), most experts empty
    "one_token": dict(T=1, d=16, E=8, K=2, f=8),
    # T smaller than the alignment: every group is mostly padding rows
    "T_lt_align": dict(T=3, d=16, E=4, K=2, f=8, align=16),
    # alignment with more tokens: padded groups between real ones
    "align8": dict(T=37, d=16, E=5, K=2, f=8, align=8),
    # shared experts: their gradients must flow too
    "shared": dict(T=16, d=16, E=4, K=2, f=8, n_shared_experts=2, d_shared=6),
    # an empty expert: expert 2 gets no pair (bias -100 on selection); its grads must be zero
    "empty_expert": dict(T=24, d=16, E=6, K=2, f=8, bias=[0, 0, -100.0, 0, 0, 0]),
    # every token on one expert: one group holds all rows, the rest are empty
    "all_on_one": dict(T=24, d=16, E=6, K=1, f=8, bias=[0, 0, 0, 100.0, 0, 0]),
    # other activations and clamps
    "geglu_clamp": dict(T=16, d=16, E=4, K=2, f=8, activation="geglu", act_clamp=0.5),
    "relu2_softcap": dict(T=16, d=16, E=4, K=2, f=8, activation="relu2", act_softcap=1.0),
    # the loop backend is a reference too, but check it runs the layer the same way
    "loop_backend": dict(T=16, d=16, E=4, K=2, f=8, backend="loop"),
    # sigmoid scores with renormalisation and scaling, group-limited routing
    "sigmoid_groups": dict(T=24, d=16, E=8, K=2, f=8, router=RouterConfig(
        score_func="sigmoid", scaling_factor=2.5, n_groups=4, topk_groups=2)),
    "sqrt_softplus": dict(T=24, d=16, E=8, K=3, f=8, router=RouterConfig(score_func="sqrt_softplus")),
    "post_softmax": dict(T=24, d=16, E=8, K=2, f=8, router=RouterConfig(pre_softmax=False)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_per_token_reference(name: str) -> None:
    case = dict(CASES[name])
    T = case.pop("T")
    d = case.pop("d")
    layer = build(d, **case)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(2))
    check_against_reference(layer, x)
    out = layer(x)
    # The statistics against an independent tally: a per-token loop over the router's choice (the
    # routing itself is tested in test_routing.py). A count moved to the wrong expert, a pair counted
    # twice or not at all shows here; the sums over experts alone would hold whatever the counts were.
    ids = layer.router(x).ids_TK
    tally = torch.zeros(layer.cfg.num_experts, dtype=torch.int64)
    for t in range(T):
        for j in range(layer.cfg.top_k):
            tally[int(ids[t, j])] += 1
    assert torch.equal(out.stats.tokens_per_expert_E, tally), (out.stats.tokens_per_expert_E, tally)
    assert out.stats.pairs_dropped is None  # the dropless plan cannot drop and computes no count of it
    assert int(out.stats.pairs_computed) == int(tally.sum())
    if name == "empty_expert":
        assert int(tally[2]) == 0
    if name == "all_on_one":
        assert int(tally[3]) == T


def test_empty_expert_gets_zero_gradient() -> None:
    layer = build(16, E=6, K=2, f=8, bias=[0, 0, -100.0, 0, 0, 0])
    _, g = grads(layer, torch.randn(24, 16), lambda x: layer(x).y)
    assert torch.count_nonzero(g["experts.w_gate_up_EDF"][2]) == 0
    assert torch.count_nonzero(g["experts.w_down_EFD"][2]) == 0


def test_three_dim_input_keeps_shape() -> None:
    layer = build(16)
    x = torch.randn(2, 5, 16)
    y = layer(x).y
    assert y.shape == x.shape
    assert torch.equal(y.view(10, 16), layer(x.view(10, 16)).y)


def test_single_expert_top1_equals_dense_mlp() -> None:
    # E=1, K=1, no shared experts: the layer must be the dense MLP with the same weights.
    d, f = 16, 24
    layer = build(d, E=1, K=1, f=f)
    mlp = MLP(d, f)
    with torch.no_grad():
        mlp.gate_up.weight.copy_(layer.experts.w_gate_up_EDF[0].t())
        mlp.down.weight.copy_(layer.experts.w_down_EFD[0].t())
    x = torch.randn(32, d)
    assert_close(layer(x).y, mlp(x), DENSE_EQUIV, msg="E=1 k=1 vs dense")


@pytest.mark.parametrize("name", ["basic", "prime_E", "align8", "shared", "k_eq_E", "empty_expert"])
def test_no_colliding_scatter_add_in_forward_or_backward(name: str) -> None:
    # The dropless path is gathers both ways (ops/permute.py), so its results and gradients do not
    # depend on the order in which a GPU's threads arrive. A rerun comparison cannot show that on CPU,
    # where index_add/scatter_add add serially and agree with themselves to the bit; so record every
    # accumulating write in forward and backward and fail on any whose index sends two contributions
    # to one element (scatter_add_check.py says why that is the criterion).
    case = dict(CASES[name])
    T, d = case.pop("T"), case.pop("d")
    layer = build(d, **case)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with record_colliding_accumulations() as found:
        out = layer(x)
        (out.y.square().sum() + out.aux_loss + out.z_loss).backward()
    assert found.found == [], found.found
    assert x.grad is not None and layer.experts.w_gate_up_EDF.grad is not None


def test_scatter_add_check_sees_an_index_add_backward() -> None:
    # The check itself: index_select differentiated by autograd has an index_add backward, which
    # collides when a row is selected twice, and is reported; a permutation is not.
    src = torch.randn(4, 3, requires_grad=True)
    with record_colliding_accumulations() as found:
        src.index_select(0, torch.tensor([0, 2, 1, 3])).sum().backward()
    assert found.found == []
    with record_colliding_accumulations() as found:
        src.index_select(0, torch.tensor([0, 2, 0, 3])).sum().backward()
    assert len(found.found) == 1 and "index_add" in found.found[0]


def test_deterministic_outputs_and_gradients() -> None:
    # Two identical calls give bit-identical outputs and gradients (stable sorts, no stale state).
    layer = build(16, E=7, K=3, f=12)
    x = torch.randn(64, 16)
    y1, g1 = grads(layer, x, lambda x: layer(x).y)
    y2, g2 = grads(layer, x, lambda x: layer(x).y)
    assert torch.equal(y1, y2)
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name


def test_no_host_sync_on_dropless_path() -> None:
    # The forward and backward must not read a device value on the host. On CPU there is no real
    # sync, so patch the host-reading methods to fail while the layer runs.
    layer = build(16, E=5, K=2, f=8, align=4)
    x = torch.randn(20, 16, requires_grad=True)
    with forbid_host_sync("host sync inside the layer"):
        out = layer(x)
        (out.y.sum() + out.aux_loss + out.z_loss).backward()
    assert x.grad is not None


def test_bf16_layer_close_to_fp32() -> None:
    layer = build(32, E=8, K=2, f=16)
    x = torch.randn(40, 32)
    y32 = layer(x).y
    layer16 = build(32, E=8, K=2, f=16).to(torch.bfloat16)
    layer16.load_state_dict(layer.state_dict())
    layer16.router.float()  # the router stays fp32, as the model keeps it
    y16 = layer16(x.bfloat16()).y
    assert y16.dtype == torch.bfloat16
    # bf16 rounds the operands of sums that cancel: each element's error follows its terms
    # (tolerances.BF16_VS_FP32), sum_j w_j * |act(x W_gate_up)| @ |W_down| from the fp32 layer.
    d, ex = layer.router(x), layer.experts
    terms = torch.zeros_like(y32)
    for t in range(x.shape[0]):
        for j in range(layer.cfg.top_k):
            e = int(d.ids_TK[t, j])
            h = activation(x[t] @ ex.w_gate_up_EDF[e], ex.kind)
            terms[t] += d.weights_TK[t, j] * (h.abs() @ ex.w_down_EFD[e].abs())
    assert_close(y16.float(), y32, BF16_VS_FP32, msg="bf16 vs fp32", terms=terms)


def test_autocast_runs_experts_in_bf16() -> None:
    layer = build(32, E=8, K=2, f=16)
    x = torch.randn(40, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.y.dtype == torch.bfloat16
    assert out.aux_loss.dtype == torch.float32  # router losses stay fp32


def test_config_is_not_mutated_by_layer() -> None:
    cfg = MoEConfig(num_experts=4, top_k=2, d_expert=8)
    before = dataclasses.asdict(cfg)
    MoELayer(16, cfg)
    assert dataclasses.asdict(cfg) == before
