"""`dropless bench layer --count-ops`: what it counts (top-level ATen ops, views apart), and the counts
it guards on the MoE layer: one sort per forward, and a GPU-path backward whose ops do not grow with
the number of rows, and the op budget of the layer (total and non-view)."""

from __future__ import annotations

import json

import torch

from dropless.bench import layer as bench
from dropless.bench import op_count
from dropless.ops import lean_experts


def test_counts_top_level_ops_only_and_sets_views_apart() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 8, requires_grad=True)
    # matmul calls mm inside (not counted again); a to() to the tensor's own dtype is a no-op view
    c = op_count.count_ops(bench._fwd_bwd(lambda t: (t.to(torch.float32) @ w).relu(), x, [w], op_count.MARKS))
    assert c.forward == {"aten::to(no-op)": 1, "aten::matmul": 1, "aten::relu": 1}
    assert c.phase("forward") == 3 and c.phase("forward", non_view=True) == 2
    assert c.backward["aten::threshold_backward"] == 1 and "aten::mm" in c.backward
    assert c.total() == c.phase("forward") + c.phase("backward")


def _layer_count(tokens: int, gpu_path: bool) -> op_count.OpCount:
    # bf16, as the documented command: the routing weights' cast to the experts' dtype is on the path
    forwards, _ = bench.build_forwards("tiny", "balanced", torch.bfloat16, only={"dropless"}, tokens=tokens)
    f = forwards["dropless"]
    _, counts = op_count.count_variants({"dropless": bench._fwd_bwd(f.fn, f.x, f.params, op_count.MARKS)},
                                        gpu_path=gpu_path)
    return counts["dropless"]


def test_the_layer_sorts_once_and_the_gpu_backward_does_not_grow_with_rows(monkeypatch) -> None:
    monkeypatch.setattr(lean_experts, "_GRAIN", 64)  # blocks of 64 // f rows: several at this size
    small, large = _layer_count(64, gpu_path=True), _layer_count(512, gpu_path=True)
    # the plan's sort gives the counts the aux loss and the statistics read (no second sort)
    assert small.forward["aten::sort"] == 1 and small.forward["aten::searchsorted"] == 1
    assert small.forward == large.forward and small.backward == large.backward
    # a budget that only goes down, at most transformers' Qwen3-MoE block (106 ops, 62 non-view, at
    # the medium shape; the layer's counts do not depend on the shape): the renormalised softmax
    # weights as a quotient of gathered scores again (3 more forward ops, 8 more backward), the aux
    # loss as cast, divide, multiply, sum, scale (3 more), `pairs_computed` or a zero `pairs_dropped`
    # made by every call, or the routing weights cast inside the experts' Function each fail here
    assert small.total() <= 96, (small.forward, small.backward)
    assert small.total(non_view=True) <= 62, (small.forward, small.backward)
    # the CPU's blocked recompute: a few ops per block of rows
    blocked = _layer_count(512, gpu_path=False)
    assert blocked.phase("backward") > large.phase("backward") + 100
    assert lean_experts.CPU_BLOCKS  # restored


def test_count_ops_command_writes_rows(tmp_path) -> None:
    out = tmp_path / "ops.json"
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--shape", "tiny", "--count-ops", "--skip", "loop_reference,padded_capacity",
                           "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert {"dropless", "dense_same_shape", "dense_wide"} <= rows.keys()
    for r in rows.values():
        assert r["ops"] == r["fwd_ops"] + r["bwd_ops"] == (sum(r["forward_by_op"].values())
                                                          + sum(r["backward_by_op"].values()))
        assert 0 < r["non_view_ops"] < r["ops"]
