"""Smoke test of `dropless bench layer` on the hidden tiny shape (the real runs are commands, not tests)."""

from __future__ import annotations

import json

import torch

from dropless.bench import layer as bench


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
    assert {"dropless", "dense_same_shape", "dense_wide", "loop_reference", "padded_capacity"} <= rows.keys()
    assert rows["dense_same_shape"]["ratio_to_dense"] == 1.0
    assert "dropless@balanced" in rows and rows["dropless"]["skew_slowdown"] > 0
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["routing"] == routing for r in rows.values())


def test_forced_routings() -> None:
    g = torch.Generator().manual_seed(0)
    ids = bench.balanced_ids(64, 16, 4, g)
    assert torch.equal(torch.bincount(ids.view(-1), minlength=16), torch.full((16,), 16))
    assert bench.max_vio(ids, 16) == 0.0
    skewed = bench.skewed_ids(256, 16, 4, g)
    # k distinct experts per token in both
    assert all(len(set(row.tolist())) == 4 for row in torch.cat([ids, skewed]))
    assert bench.max_vio(skewed, 16) > 0.5
