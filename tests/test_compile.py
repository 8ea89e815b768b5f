"""The MoE layer under `torch.compile(fullgraph=True)` on CPU: one graph, same results as eager.

fullgraph=True turns any graph break into an error, and a graph break in this layer would be a host
read of device data (`.item()`, `int()`, a Python branch on a tensor) or an op the compiler cannot
trace; so this test is the CPU proof that the layer has neither, the meta-device test's sibling
(tests/test_meta_device.py). backend="aot_eager" traces forward and backward through AOTAutograd
(what inductor consumes) but runs eager kernels: seconds, not the minute inductor's C++ build takes
here. Shapes are static (dynamic=False).

torch's shape rule for grouped_mm (used while tracing) accepts bf16 only; fp32 experts trace through
dropless's custom op with the same kernel (ops/grouped_mm_op.py), so the layer is checked with bf16
weights, with fp32 weights under bf16 autocast (the trainer on AMX CPUs and GPUs), and in fp32.
"""

from __future__ import annotations

import pytest
import torch

from dropless.config import MoEConfig, RouterConfig
from dropless.layers.moe import MoELayer
from tolerances import COMPILED, assert_close

# Why each case: token choice with every selection option (group-limited, expert bias) plus alignment
# padding and a shared expert; expert choice with padding (a masked plan: variable experts per
# token); forced balance (random draws on the device inside the graph).
CASES = {
    "token_choice_group_bias_align4_shared": dict(
        align=4, n_shared_experts=1, d_shared=16,
        router=RouterConfig(n_groups=4, topk_groups=2, use_expert_bias=True)),
    "expert_choice_align4": dict(align=4, router=RouterConfig(strategy="expert_choice")),
    "forced_balance": dict(router=RouterConfig(strategy="forced_balance")),
    # identity experts: the split into a masked plan, the select and the weighted input
    "identity_experts": dict(n_identity_experts=2),
    # LatentMoE with its norm: two dense projections around the routed part
    "latent_norm": dict(latent_dim=16, latent_norm=True),
}


def _outputs_and_grads(layer: MoELayer, fn, x0: torch.Tensor, autocast: bool) -> dict[str, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    torch.manual_seed(1)  # forced balance draws from the default generator: the same draws both ways
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y, aux, z, counts = fn(x)
    (y.float().square().mean() + aux + z).backward()
    out = {"y": y.detach().float(), "aux": aux.detach(), "z": z.detach(), "counts": counts, "grad x": x.grad}
    out.update({f"grad {n}": p.grad for n, p in layer.named_parameters()})
    return out


def _check_compiled_matches_eager(layer: MoELayer, x0: torch.Tensor, autocast: bool,
                                  tol: tuple[float, float] | None = COMPILED) -> None:
    """tol None: bit for bit."""
    def forward(x: torch.Tensor):
        out = layer(x)
        return out.y, out.aux_loss, out.z_loss, out.stats.tokens_per_expert_E

    eager = _outputs_and_grads(layer, forward, x0, autocast)
    compiled = _outputs_and_grads(layer, torch.compile(forward, backend="aot_eager", fullgraph=True,
                                                       dynamic=False), x0, autocast)
    assert eager.keys() == compiled.keys()
    assert torch.equal(compiled["counts"], eager["counts"])  # routing is an index op: exact
    for name in eager:
        if name != "counts" and tol is None:
            assert torch.equal(compiled[name], eager[name]), name
        elif name != "counts":
            assert_close(compiled[name], eager[name], tol, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_layer_matches_eager_bf16(case: str) -> None:
    torch.manual_seed(0)
    layer = MoELayer(32, MoEConfig(num_experts=8, top_k=2, d_expert=16, **CASES[case])).to(torch.bfloat16)
    layer.router.float()  # as the model keeps it
    _check_compiled_matches_eager(layer, torch.randn(2, 12, 32).to(torch.bfloat16), autocast=False)


def test_compiled_layer_matches_eager_under_autocast() -> None:
    torch.manual_seed(0)
    layer = MoELayer(32, MoEConfig(num_experts=8, top_k=2, d_expert=16))
    _check_compiled_matches_eager(layer, torch.randn(2, 12, 32), autocast=True)


@pytest.mark.parametrize("case", ["token_choice_group_bias_align4_shared", "latent_norm"])
def test_compiled_layer_matches_eager_fp32(case: str) -> None:
    """fp32 through the custom op: the same kernel on the same operands, so the same bits."""
    torch.manual_seed(0)
    layer = MoELayer(32, MoEConfig(num_experts=8, top_k=2, d_expert=16, **CASES[case]))
    _check_compiled_matches_eager(layer, torch.randn(2, 12, 32), autocast=False, tol=None)


def test_layer_forward_never_asks_torch_for_autocast_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    """dynamo on torch 2.11 cannot trace `torch.amp.is_autocast_available` (a call into torch._C), so
    fullgraph compile of the layer failed there (seen on an H200 machine; torch 2.13 traces it). The
    layer asks `ops.autocast.autocast_available` instead; any direct call in the forward fails here."""
    def refuse(device_type: str) -> bool:
        raise AssertionError(f"torch.amp.is_autocast_available({device_type!r}) called in the forward")

    layer = MoELayer(32, MoEConfig(num_experts=8, top_k=2, d_expert=16, **CASES["token_choice_group_bias_align4_shared"]))
    monkeypatch.setattr(torch.amp, "is_autocast_available", refuse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(12, 32)).y.float().sum().backward()
