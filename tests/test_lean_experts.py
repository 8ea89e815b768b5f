"""The lean experts (ops/lean_experts.py) and the router's lean GEMM (ops/routing.router_logits).

Bit-exactness (torch.equal) is claimed against the plain composition, the keep-everything path
(`GroupedExperts.lean = False`): the lean Function runs the same kernels on the same operands in its
forward, and in its backward the products torch's autograd runs for the plain path (the grouped
GEMM's backward formula, mm's backward per expert for the loop), the same activation ops on the same
strided halves of h, and the same gather-sum back to the tokens (docs/numerics.md: same computation,
same bits). The memory claim is checked on what autograd saves: no [R, D] or [R, F] tensor.
"""

from __future__ import annotations

import pytest
import torch

from dropless.config import MoEConfig, RouterConfig, load_config
from dropless.layers.moe import MoELayer
from dropless.ops import grouped_gemm, routing
from dropless.ops.lean_experts import RowSource, lean_experts, lean_experts_reference
from dropless.saved_bytes import saved_bytes

# Why each shape exists (T tokens, d, E, K, f, extra config):
SHAPES = {
    "basic": (24, 16, 8, 2, 12, {}),
    # an expert with no rows: its weight gradients are zero, its group empty in every GEMM
    "empty_expert": (24, 16, 6, 2, 8, {"bias": [0, 0, -100.0, 0, 0, 0]}),
    # every token on one expert: one group holds all rows, the others are empty
    "all_on_one": (20, 16, 5, 1, 8, {"bias": [0, 0, 0, 100.0, 0]}),
    # prime E, K=3: no power-of-two assumption in offsets or group sizes
    "prime_E": (30, 16, 7, 3, 12, {}),
    # odd widths: grouped_mm pads d and f to 16-byte strides; the backward must pad the same way
    "odd_widths": (20, 13, 5, 2, 7, {}),
    # k=1 and k=E: one row per token, and every expert on every token
    "k1": (20, 16, 6, 1, 8, {}),
    "kE": (12, 16, 4, 4, 8, {}),
    # align=4: padding rows (src_R = T, the zero row) inside the groups and past the last one
    "align4": (24, 16, 8, 2, 12, {"align": 4}),
    # 512 rows per group in bf16 on the CPU: the uniform plan (every group C rows, batched matmuls)
    "uniform": (1024, 16, 4, 2, 8, {}),
    # ... with an expert that gets no rows: its group is all padding
    "uniform_empty": (768, 16, 4, 2, 8, {"bias": [0, 0, -100.0, 0]}),
}
ACTIVATIONS = {
    "swiglu": {},  # the fused path
    "geglu": {"activation": "geglu"},  # the generic recompute under enable_grad
    "relu2": {"activation": "relu2"},
    "swiglu_clamp": {"act_clamp": 2.0},
    "swiglu_softcap": {"act_softcap": 3.0},
}


def build(shape: str, act: str = "swiglu", backend: str = "grouped_mm", **kw) -> tuple[MoELayer, torch.Tensor]:
    T, d, E, K, f, extra = SHAPES[shape]
    extra = dict(extra)
    bias = extra.pop("bias", None)
    cfg = MoEConfig(num_experts=E, top_k=K, d_expert=f, backend=backend,
                    router=RouterConfig(use_expert_bias=bias is not None), **extra, **ACTIVATIONS[act], **kw)
    torch.manual_seed(0)
    layer = MoELayer(d, cfg)
    if bias is not None:
        layer.router.set_bias(torch.tensor(bias))
    return layer, torch.randn(T, d, generator=torch.Generator().manual_seed(2))


def run(layer: MoELayer, x0: torch.Tensor, lean: bool, autocast: bool = False) -> dict[str, torch.Tensor]:
    layer.experts.lean = lean
    layer.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = layer(x).y
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    (y * g).float().sum().backward()
    out = {"y": y.detach(), "grad x": x.grad}
    out.update({f"grad {n}": p.grad for n, p in layer.named_parameters()})
    layer.experts.lean = True
    return out


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] is not None and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_lean_equals_keep_act_fp32(shape: str, backend: str) -> None:
    layer, x = build(shape, backend=backend)
    lean = run(layer, x, True)
    assert_equal(lean, run(layer, x, False))
    if shape == "empty_expert":
        assert torch.count_nonzero(lean["grad experts.w_gate_up_EDF"][2]) == 0
        assert torch.count_nonzero(lean["grad experts.w_down_EFD"][2]) == 0


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("shape", ["basic", "odd_widths", "align4"])
def test_lean_equals_keep_act_every_activation(shape: str, act: str) -> None:
    layer, x = build(shape, act)
    assert_equal(run(layer, x, True), run(layer, x, False))


@pytest.mark.parametrize("shape", ["basic", "odd_widths", "align4"])
def test_lean_equals_keep_act_bf16_and_autocast(shape: str) -> None:
    layer, x = build(shape)
    # bf16 autocast over fp32 weights (what the trainer runs on AMX CPUs): the rows are re-gathered
    # from the fp32 input and cast again, the input gradient summed in fp32 as before
    assert_equal(run(layer, x, True, autocast=True), run(layer, x, False, autocast=True))
    layer = layer.to(torch.bfloat16)
    layer.router.float()
    xb = x.to(torch.bfloat16)
    assert_equal(run(layer, xb, True), run(layer, xb, False))


@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize("shape", ["uniform", "uniform_empty"])
def test_lean_equals_keep_act_on_a_uniform_plan(shape: str, act: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 autocast on the CPU, groups even enough for the uniform plan: the lean Function runs
    bmm's forward and its autograd backward products, as the plain path's bmm (grouped_gemm.py)."""
    monkeypatch.setattr(grouped_gemm, "UNIFORM_LIMIT", {})
    monkeypatch.setattr(grouped_gemm, "UNIFORM_LIMIT_THREADED", 2.0)
    layer, x = build(shape, act)
    with torch.autocast("cpu", torch.bfloat16):
        batch, _ = layer.dispatcher.dispatch(x, layer.router(x))
    assert batch.capacity is not None and batch.x_RD.shape[0] == 4 * batch.capacity
    lean = run(layer, x, True, autocast=True)
    assert_equal(lean, run(layer, x, False, autocast=True))
    if shape == "uniform_empty":
        assert torch.count_nonzero(lean["grad experts.w_gate_up_EDF"][2]) == 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("shape", ["basic", "odd_widths", "align4", "k1"])
def test_lean_blocked_swiglu_backward_equals_keep_act(shape: str, dtype: str, threads: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The fused SwiGLU's recompute and backward run in blocks of rows (lean_experts.
    # _swiglu_recompute_backward). At the test shapes R is below one block, so a tiny grain forces
    # blocks of 3 rows, with a partial last block: the result must still be the whole-tensor one.
    # With 2 threads the blocked path only runs where the split falls on rows (`_row_aligned`).
    from dropless.ops import lean_experts as lean_mod
    f = SHAPES[shape][4]
    monkeypatch.setattr(lean_mod, "_GRAIN", 3 * f)
    calls = []
    real = lean_mod.swiglu_backward
    monkeypatch.setattr(lean_mod, "swiglu_backward", lambda *a: calls.append(1) or real(*a))
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer, x = build(shape)
        if dtype == "bf16":
            layer = layer.to(torch.bfloat16)
            layer.router.float()
            x = x.to(torch.bfloat16)
        auto = dtype == "autocast"
        assert_equal(run(layer, x, True, autocast=auto), run(layer, x, False, autocast=auto))
    finally:
        torch.set_num_threads(old_threads)
    if threads == 1:
        assert not calls  # the blocked path ran, not the whole-tensor fallback


@pytest.mark.parametrize("dtype", ["bf16", "autocast"])
def test_lean_blocked_swiglu_two_threads_real_grain(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # At torch's real grain and 2 threads, a whole block is one grain per thread (torch splits it on
    # row boundaries, both threads working) and the rows past the last whole block go one grain at a
    # time. R = 300 tokens x 2 = 600 rows of f = 256: two whole blocks of 256 rows, then 88 rows.
    from dropless.ops import lean_experts as lean_mod
    calls, starts = [], []
    real = lean_mod.swiglu_backward
    monkeypatch.setattr(lean_mod, "swiglu_backward", lambda *a: calls.append(1) or real(*a))
    real_silu = torch.ops.aten.silu.out
    old_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = MoEConfig(num_experts=7, top_k=2, d_expert=256, router=RouterConfig())
        torch.manual_seed(0)
        layer = MoELayer(64, cfg)
        x = torch.randn(300, 64, generator=torch.Generator().manual_seed(2))
        if dtype == "bf16":
            layer = layer.to(torch.bfloat16)
            layer.router.float()
            x = x.to(torch.bfloat16)
        auto = dtype == "autocast"
        want = run(layer, x, False, autocast=auto)
        monkeypatch.setattr(torch.ops.aten.silu, "out", lambda g, out: starts.append(g.shape[0]) or real_silu(g, out=out))
        got = run(layer, x, True, autocast=auto)
        assert_equal(got, want)
    finally:
        torch.set_num_threads(old_threads)
    assert not calls  # the blocked path ran
    assert starts == [256, 256, 88]


def test_lean_with_shared_expert_and_masked_plan() -> None:
    # expert choice: a validity-masked plan (invalid pairs get no row; padding rows read row T)
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=6, top_k=2, d_expert=8, n_shared_experts=1, d_shared=8,
                    router=RouterConfig(strategy="expert_choice"))
    layer = MoELayer(16, cfg)
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(3))
    assert_equal(run(layer, x, True), run(layer, x, False))


def _big_saved(layer: MoELayer, x: torch.Tensor, lean: bool) -> list[tuple[tuple[int, ...], int]]:
    """(shape, numel) of every saved storage of at least R * min(d, f) elements, R = T*K rows."""
    layer.experts.lean = lean
    count = saved_bytes(lambda x: layer(x).y, x.requires_grad_(True), exclude=list(layer.parameters()))
    layer.experts.lean = True
    T, d = x.shape
    R, f = T * layer.cfg.top_k, layer.cfg.d_expert
    return [(shape, n // torch.empty((), dtype=dt).element_size())
            for shape, dt, n in count.items if n // torch.empty((), dtype=dt).element_size() >= R * min(d, f)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_keeps_only_h_among_row_sized_tensors(dtype: torch.dtype) -> None:
    """The lean layer keeps no T*K x d rows, no silu(gate), no activation and no expert outputs:
    the only saved storage with R*min(d, f) elements or more is h ([R, 2f]). The keep-everything
    path (the same check's negative) keeps x_RD, h, silu(gate) and the activation."""
    T, d, E, K, f = 32, 24, 4, 3, 16  # T*E < R*min(d, f): the router's [T, E] tensors stay below
    torch.manual_seed(0)
    layer = MoELayer(d, MoEConfig(num_experts=E, top_k=K, d_expert=f)).to(dtype)
    layer.router.float()
    x = torch.randn(T, d).to(dtype)
    assert _big_saved(layer, x, True) == [((T * K, 2 * f), T * K * 2 * f)]
    # the router keeps the input as given, no fp32 copy of it (routing.router_logits)
    count = saved_bytes(lambda x: layer(x).y, x.requires_grad_(True), exclude=list(layer.parameters()))
    assert [dt for shape, dt, _ in count.items if shape == (T, d)] == [dtype]
    keep = sorted(_big_saved(layer, x, False))
    assert keep == sorted([((T * K, d), T * K * d), ((T * K, 2 * f), T * K * 2 * f),
                           ((T * K, f), T * K * f), ((T * K, f), T * K * f)]), keep


def test_lean_experts_op_against_reference_without_source() -> None:
    """The op alone, as expert parallelism calls it (no RowSource: the received rows are kept), and
    with a source, against the plain composition: outputs and every gradient, torch.equal."""
    g = torch.Generator().manual_seed(4)
    T, D, E, F = 10, 16, 3, 8
    x_TD = torch.randn(T, D, generator=g)
    src_R = torch.tensor([0, 3, 3, 7, 9, 1, 10, 2, 5, 6, 8, 10])  # 10 = the zero padding row
    offsets_E = torch.tensor([4, 4, 11], dtype=torch.int32)  # an empty group; one row past the end
    w1, w2 = torch.randn(E, D, 2 * F, generator=g), torch.randn(E, F, D, generator=g)
    w_R = torch.rand(12, generator=g)

    def grads(fn, with_source: bool):
        leaves = [t.clone().requires_grad_(True) for t in (x_TD, w1, w2, w_R)]
        x, a, b, w = leaves
        x_RD = torch.cat([x, x.new_zeros(1, D)]).index_select(0, src_R)
        source = RowSource(x, src_R, True) if with_source else None
        y = fn(x_RD, a, b, offsets_E, w, source)[:11]  # rows past the last group end are unread
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(5)))
        # row 11 lies past the last group end: grouped_mm leaves its h and dgrad uninitialised on
        # both sides, so its weight gradient is garbage (the layer never reads it); compare the rest
        return [y.detach(), x.grad, a.grad, b.grad, w.grad[:11]]

    ref = grads(lean_experts_reference, False)
    for with_source in (False, True):
        got = grads(lean_experts, with_source)
        for name, a, b in zip(("y", "x", "w1", "w2", "w_R"), got, ref):
            assert torch.equal(a, b), (name, with_source)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 37])
def test_router_logits_equal_reference_and_keep_the_input(dtype: torch.dtype, T: int) -> None:
    g = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(T, 24, generator=g).to(dtype), torch.randn(8, 24, generator=g)
    res = []
    for fn in (routing.router_logits, routing.router_logits_reference):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        y = fn(x, w)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        res.append((y, x.grad, w.grad))
    for a, b in zip(*res):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # what it keeps: the input itself, no fp32 copy
    w = w0.clone().requires_grad_(True)
    count = saved_bytes(lambda x: routing.router_logits(x, w), x0.clone().requires_grad_(True), exclude=[w])
    assert [(s, dt) for s, dt, _ in count.items] == [((T, 24), dtype)]


@pytest.mark.parametrize("extra, words", [
    (['model.recompute=["moe_act", "moe"]'], "recomputes the expert activation already"),
    (['model.recompute=["moe_act"]', "model.moe.precision=mxfp8"], "low-precision"),
    (['model.recompute=["moe_act"]', "model.moe.capacity_factor=1.25"], "capacity"),
])
def test_moe_act_refused_where_the_lean_path_does_not_run(extra: list[str], words: str) -> None:
    with pytest.raises(ValueError, match="model.recompute") as err:
        load_config(None, extra)
    assert words in str(err.value)


def test_moe_act_accepted() -> None:
    cfg = load_config(None, ['model.recompute=["moe_act", "attn"]'])
    assert cfg.model.recompute == ["moe_act", "attn"]
