"""Smoke test of `dropless bench layer` on the hidden tiny shape (the real runs are commands, not tests):
the variants that claim to compute the MoE layer compute it, and the JSON's figures agree with the
timings and the routing they were derived from."""

from __future__ import annotations

import json

import pytest
import torch

from dropless.bench import layer as bench
from dropless.ops.capacity_plan import capacity
from tolerances import assert_close


def test_bench_layer_tiny_runs(tmp_path) -> None:
    # skewed covers the most code (it adds the dropless@balanced row); most of the time is the
    # import of transformers and its grouped_mm check, when it is installed
    routing = "skewed"
    out = tmp_path / "rows.json"
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--shape", "tiny", "--routing", routing, "--repeats", "2", "--warmup", "1",
                           "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert {"dropless", "dense_same_shape", "dense_wide", "loop_reference", "padded_capacity",
            "dropless@balanced"} <= rows.keys()
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["routing"] == routing for r in rows.values())
    # the derived columns from the timed ones: ratio_to_dense is dense fwd+bwd / the row's fwd+bwd,
    # the skew slowdown is skewed / balanced fwd+bwd of the dropless path
    dense = rows["dense_same_shape"]["fwd_bwd_ms"]
    for name, r in rows.items():
        assert r["ratio_to_dense"] == pytest.approx(dense / r["fwd_bwd_ms"], rel=1e-12), name
    assert rows["dropless"]["skew_slowdown"] == pytest.approx(
        rows["dropless"]["fwd_bwd_ms"] / rows["dropless@balanced"]["fwd_bwd_ms"], rel=1e-12)
    # the routing figures, recomputed from the same seeded routing with a plain bincount
    T, D, E, K, F = bench.SHAPES["tiny"]
    r = rows["dropless"]
    assert (r["T"], r["d"], r["E"], r["k"], r["f"], r["dtype"]) == (T, D, E, K, F, "bfloat16")
    ids = bench.skewed_ids(T, E, K, torch.Generator().manual_seed(0))
    load = torch.bincount(ids.view(-1), minlength=E)
    assert r["max_vio"] == pytest.approx(float(load.max()) * E / (T * K) - 1, rel=1e-6)
    # padded_capacity's factor is the smallest that drops nothing: C equals the largest load
    assert capacity(T, K, E, r["capacity_factor"]) == int(load.max())


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_bench_variants_compute_the_same_layer(routing: str) -> None:
    # dropless, loop_reference and padded_capacity time the same MoE layer (same weights, same forced
    # routing) in three ways: their outputs and input gradients must agree, or the timings compare
    # different work. fp32, so the comparison is at the reference tolerance.
    variants, meta = bench.build_variants("tiny", routing, torch.float32)
    assert meta["routing"] == routing
    ys, dxs = {}, {}
    for name in ("dropless", "loop_reference", "padded_capacity"):
        fwd, fwd_bwd = variants[name]
        ys[name] = fwd()
        dxs[name] = fwd_bwd().clone()
    assert ys["loop_reference"].abs().max() > 0 and dxs["loop_reference"].abs().max() > 0
    for name in ("dropless", "padded_capacity"):
        assert_close(ys[name], ys["loop_reference"], msg=f"{name} output")
        assert_close(dxs[name], dxs["loop_reference"], msg=f"{name} input gradient")


def test_forced_routings() -> None:
    g = torch.Generator().manual_seed(0)
    ids = bench.balanced_ids(64, 16, 4, g)
    assert torch.equal(torch.bincount(ids.view(-1), minlength=16), torch.full((16,), 16))
    assert bench.max_vio(ids, 16) == 0.0
    skewed = bench.skewed_ids(256, 16, 4, g)
    # k distinct experts per token in both
    assert all(len(set(row.tolist())) == 4 for row in torch.cat([ids, skewed]))
    assert bench.max_vio(skewed, 16) > 0.5
