"""The saved-bytes counter (saved_bytes.py) on autograd graphs whose answer is known by hand, the MoE
layer floor formula, and `dropless bench memory` on the hidden tiny shape (the real runs are
commands in docs/memory.md, not tests)."""

from __future__ import annotations

import json

import pytest
import torch

from dropless.bench import layer as bench_layer
from dropless.bench import memory as bench
from dropless.saved_bytes import saved_bytes


def test_mm_saves_both_operands() -> None:
    # mm(a, b) keeps b for grad_a and a for grad_b: both storages, nothing else
    a = torch.randn(5, 7, requires_grad=True)
    b = torch.randn(7, 3, requires_grad=True)
    count = saved_bytes(torch.mm, a, b)
    assert count.bytes == (5 * 7 + 7 * 3) * 4
    assert (count.storages, count.tensors, count.excluded) == (2, 2, 0)
    assert torch.equal(count.out, a @ b)


def test_views_of_one_storage_count_once() -> None:
    # mm(x, x.t()) saves x twice, once as a transposed view: one storage of 6*4 fp32
    x = torch.randn(6, 4, requires_grad=True)
    count = saved_bytes(lambda t: t @ t.t(), x)
    assert count.bytes == 6 * 4 * 4
    assert (count.storages, count.tensors) == (1, 2)


def test_a_saved_slice_costs_its_whole_storage() -> None:
    # sin saves its input, here one row of a 100-row tensor: the row keeps all 100 rows alive
    x = torch.randn(100, 4, requires_grad=True)
    count = saved_bytes(lambda t: t[:1].sin(), x)
    assert count.bytes == 100 * 4 * 4


def test_parameters_and_buffers_excluded() -> None:
    # linear saves its input and its weight; a module's parameters are excluded, so only x counts,
    # in bf16 (2 bytes) to tell it from the fp32 weight
    lin = torch.nn.Linear(8, 16, bias=False)
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    lin.to(torch.bfloat16)
    count = saved_bytes(lin, x)
    assert count.bytes == 3 * 8 * 2
    assert (count.storages, count.excluded) == (1, 1)
    # a plain function: the same exclusion through `exclude`, and without it the weight counts
    w = lin.weight
    assert saved_bytes(lambda t: t @ w.t(), x, exclude=[w]).bytes == 3 * 8 * 2
    assert saved_bytes(lambda t: t @ w.t(), x).bytes == 3 * 8 * 2 + 16 * 8 * 2
    # a buffer (a rotary table, say) counts as a constant of the module
    mod = torch.nn.Module()
    mod.register_buffer("scale", torch.randn(3, 8))
    mod.forward = lambda t: t.sin() * mod.scale  # sin saves t; mul saves the buffer (for grad of sin)
    count = saved_bytes(mod, torch.randn(3, 8, requires_grad=True))
    assert (count.bytes, count.storages, count.excluded) == (3 * 8 * 4, 1, 1)


def test_op_that_saves_nothing_counts_zero() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    count = saved_bytes(lambda t: (t + 1).sum(), x, include_inputs=False)  # add, sum: no tensors kept
    assert (count.bytes, count.tensors) == (0, 0)
    # by default the input counts, saved or not (once: the same storage when it is also saved)
    assert saved_bytes(lambda t: (t + 1).sum(), x).bytes == 4 * 4 * 4
    assert saved_bytes(lambda t: t.sin(), x).bytes == 4 * 4 * 4


def test_input_counted_beside_its_saved_cast() -> None:
    # a bf16 input cast to fp32 before the op: autograd keeps only the fp32 copy; the input itself
    # is what the caller must keep too (the dropless router does this: x.float() for its fp32 GEMM)
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    assert saved_bytes(lambda t: t.float().sin(), x, include_inputs=False).bytes == 4 * 8 * 4
    assert saved_bytes(lambda t: t.float().sin(), x).bytes == 4 * 8 * (4 + 2)


def test_count_held_sees_a_checkpoints_inputs() -> None:
    """A checkpoint keeps the tensors its region's function captures by reference (not as saved
    tensors: layers/recompute.py's `recomputed_routed` passes none as arguments) and shadows the
    counter's hooks inside the region: only count_held sees what it keeps. The output is not counted
    unless something saved it."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(4, 8, requires_grad=True)

    def region(x: torch.Tensor) -> torch.Tensor:
        h = x * 2  # created by the forward, saved by nothing (a multiply by a number)
        return checkpoint(lambda: h.sin().cos(), use_reentrant=False)

    assert saved_bytes(region, x).bytes == 4 * 8 * 4  # the input only
    held = saved_bytes(region, x, count_held=True)
    assert held.bytes == 2 * 4 * 8 * 4 and held.storages == 2  # the input and h
    # without a checkpoint the same region saves h and sin(h) (cos's input); the output cos(...) is
    # held by the caller, not counted
    plain = lambda x: (x * 2).sin().cos()  # noqa: E731
    assert saved_bytes(plain, x, count_held=True).bytes == saved_bytes(plain, x).bytes == 3 * 4 * 8 * 4


def test_meta_tensors_are_told_apart() -> None:
    # every meta storage has data_ptr 0; the count keys by storage identity, so it is the same as
    # on the CPU (a planner can count without allocating)
    def f(a, b):
        return torch.mm(a, b).sin()

    cpu = saved_bytes(f, torch.randn(5, 7, requires_grad=True), torch.randn(7, 3, requires_grad=True))
    meta = saved_bytes(f, torch.empty(5, 7, device="meta", requires_grad=True),
                       torch.empty(7, 3, device="meta", requires_grad=True))
    assert meta.bytes == cpu.bytes == (5 * 7 + 7 * 3 + 5 * 3) * 4


def test_floor_formula() -> None:
    # the floor's figure: medium (d=1024, k=8, f=512) in bf16 is 2*1024 + 4*8*512 = 18,432 B
    assert bench.floor_bytes_per_token(1024, 8, 512, 2) == 18_432
    assert bench.floor_bytes_per_token(1024, 8, 512, 4) == 4 * 1024 + 4 * 8 * 2 * 512
    assert bench.floor_bytes_per_token(1024, 8, 512, 2, gated=False) == 2 * 1024 + 2 * 8 * 512


@pytest.mark.parametrize("activation,gated", [("swiglu", True), ("relu2", False)])
def test_layer_floor_reads_the_expert_weights(activation: str, gated: bool) -> None:
    # the floor of a built layer: D, F and the gate|up width (2F only for a gated activation) from
    # its expert weights, K from its config; a 48-wide latent layer's rows are 48 wide, not d
    from dropless.config import MoEConfig
    from dropless.layers.moe import MoELayer

    with torch.device("meta"):
        layer = MoELayer(64, MoEConfig(num_experts=4, top_k=2, d_expert=16, activation=activation, latent_dim=48))
    assert bench.layer_floor_bytes_per_token(layer, 2) == bench.floor_bytes_per_token(48, 2, 16, 2, gated=gated)


def test_bench_memory_tiny_writes_every_key(tmp_path) -> None:
    out = tmp_path / "rows.json"
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--shape", "tiny", "--device", "cpu", "--repeats", "1", "--warmup", "0",
                           "--breakdown", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = {(r["scope"], r["variant"]): r for r in json.loads(out.read_text())}
    assert {("layer", "dropless"), ("layer", "dense_same_shape"), ("layer", "floor"),
            ("block", "dropless")} <= rows.keys()
    T, D, E, K, F = bench_layer.SHAPES["tiny"]
    floor = 2 * D + 2 * K * 2 * F
    for key, r in rows.items():
        assert {"saved_bytes_per_token", "peak_bytes", "fwd_bwd_ms", "floor_bytes_per_token"} <= r.keys()
        assert r["floor_bytes_per_token"] == floor and r["T"] == T
        assert r["peak_bytes"] is None, key  # the CPU allocator reports no peak: null, not a guess
        if key[1] != "floor":
            assert r["fwd_bwd_ms"] > 0
            # the breakdown lists the storages that make up the figure
            assert sum(n for *_, n in r["saved_storages"]) == pytest.approx(r["saved_bytes_per_token"])
    assert rows[("layer", "floor")]["saved_bytes_per_token"] == floor
    # dense_same_shape by hand, per token, bf16: its input leaf x_PD (K*D), and for each of the K
    # rows the SwiGLU input h (2F) and silu(gate) (F) that weighted_swiglu saves, and the input
    # of the down projection (F); the weights are parameters (excluded)
    assert rows[("layer", "dense_same_shape")]["saved_bytes_per_token"] == 2 * K * (D + 2 * F + F + F)
    # the block keeps more than its MoE layer (attention, norms), the layer more than the floor
    layer = rows[("layer", "dropless")]["saved_bytes_per_token"]
    assert floor < layer < rows[("block", "dropless")]["saved_bytes_per_token"]
    # every dropless variant in the scopes where it applies
    for name, (modes, _) in bench.DROPLESS_VARIANTS.items():
        assert {(scope, name) for scope in modes} <= rows.keys(), name
    # the whole MoE layer or the whole block recomputed: kept are the checkpoint's input (bf16 x,
    # held by reference, which only count_held sees) and the forward's expert ids (int64, K a token)
    for key in [("layer", "dropless_recompute_moe"), ("block", "dropless_recompute_layer")]:
        assert rows[key]["saved_bytes_per_token"] == 2 * D + 8 * K, key
    # the keep-everything experts keep x_RD, silu(gate) and the activation (bf16, K rows a token) that
    # the lean ones drop; the lean ones' row index is the one combine keeps anyway (no extra bytes);
    # the lean ones keep the routing weights in the compute dtype (bf16: 2 bytes a row, cast once
    # before their Function), the keep-everything ones in fp32 (4)
    keep = rows[("layer", "dropless_keep_act")]["saved_bytes_per_token"]
    assert keep - layer == 2 * K * (D + F + F) + (4 - 2) * K


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--tokens", "63"], ["--repeats", "0"],
                                  pytest.param(["--device", "cuda"], marks=NO_CUDA)])
def test_bench_memory_bad_input(tmp_path, capsys, argv) -> None:
    # T=63 with balanced routing: E=8 does not divide T*K=126 (a ValueError from the routing draw)
    out = tmp_path / "rows.json"
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--json", str(out), *argv]) == 2
    assert capsys.readouterr().err.startswith("dropless bench memory: error: ")
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_memory_cuda_reports_peak(tmp_path) -> None:
    # the CUDA allocator's peak over one fwd+bwd: above what was allocated at the start (weights,
    # input), and at least the saved bytes (the input among them), all alive at the end of the forward
    out = tmp_path / "rows.json"
    assert bench.main(["--shape", "tiny", "--device", "cuda", "--repeats", "1", "--warmup", "0",
                       "--json", str(out)]) == 0
    T = bench_layer.SHAPES["tiny"][0]
    for r in json.loads(out.read_text()):
        if r["variant"] != "floor":
            assert r["device"].startswith("cuda")
            assert 0 < r["peak_over_start_bytes"] < r["peak_bytes"]
            assert r["peak_bytes"] >= r["saved_bytes_per_token"] * T


def test_measure_peak_reads_the_allocator_around_one_warm_call(monkeypatch) -> None:
    # the CUDA path without a GPU: the allocator's counters faked, the order of events recorded.
    # One untimed call, gradients dropped, then reset, start, the measured call, the peak.
    events = []
    x = torch.randn(2, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(2))
    row = bench.Row(lambda t: t * w, x, [w])

    def fwd_bwd():
        events.append("call")
        x.grad = torch.zeros(2)
        w.grad = torch.zeros(2)

    def allocated(device):
        events.append(("start", x.grad is None and w.grad is None))
        return 1000

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: events.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1500)
    assert bench.measure_peak(row, fwd_bwd, torch.device("cuda")) == (1500, 500)
    assert events == ["call", "reset", ("start", True), "call"]
    assert bench.measure_peak(row, fwd_bwd, torch.device("cpu")) == (None, None)  # no CPU figure


def test_layer_counts_the_same_on_the_meta_device() -> None:
    # what the planner will lean on: the MoE layer's saved bytes counted without allocating (meta)
    # equal the CPU count, storage for storage
    counts = {}
    for device in ("cpu", "meta"):
        forwards, _ = bench_layer.build_forwards("tiny", "balanced", torch.bfloat16, device=torch.device(device),
                                                 only=["dropless", "dense_same_shape"])
        counts[device] = {n: saved_bytes(f.fn, f.x, exclude=f.params).items for n, f in forwards.items()}
    assert counts["meta"] == counts["cpu"]
    assert len(counts["cpu"]["dropless"]) > 10
