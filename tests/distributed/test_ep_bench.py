"""`dropless bench ep` runs end to end on a tiny world and writes the documented JSON keys, with byte
counts that match the routing its ranks draw, recomputed here without the dispatcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dropless.cli import main
from dropless.distributed.ep import link_capacity

T, D, E, K, W = 16, 16, 8, 4, 2  # tokens per rank, width, experts, top-k, ranks
BF16_BYTES, META_BYTES = 2, 8  # a bf16 row element; per pair with de-dup: fp32 weight + int32 row index
WEIGHT_BYTES = 4  # per pair without de-dup: its fp32 routing weight travels beside the row


def expected_bytes(row: int = D * 2) -> dict[str, tuple[int, int, int]]:
    """(bytes_sent, bytes_sent_without_dedup, combine trip bytes) summed over ranks, per mode, from each
    rank's routing as the bench draws it (generator seeded with the rank: x, then the logits, softmax
    top-k). The combine trip sends back the rows received: one per (token, rank) with de-dup, one per
    pair without; buffered mode sends its whole fixed blocks."""
    L = E // W
    pairs = rows = 0
    for rank in range(W):
        gen = torch.Generator().manual_seed(rank)
        torch.randn(T, D, generator=gen)  # x, drawn first
        ids = torch.softmax(torch.randn(T, E, generator=gen), -1).topk(K, -1).indices
        pairs += ids.numel()  # every pair goes out (its own rank counts as a link too)
        rows += sum(len(set((ids[t] // L).tolist())) for t in range(T))  # de-dup: one row per (token, rank)
    C = link_capacity(T, K, L, W, 2.0)  # the bench's default --factor
    Cr = min(C, T)
    links = W * W
    plain, plain_buffered = pairs * (row + WEIGHT_BYTES), links * C * (row + WEIGHT_BYTES)
    back = D * BF16_BYTES  # the combine trip's rows stay bf16 whatever the payload
    return {
        "exact": (plain, plain, pairs * back),
        "exact+dedup": (rows * row + pairs * META_BYTES, plain, rows * back),
        "buffered": (plain_buffered, plain_buffered, links * C * back),
        "buffered+dedup": (links * (Cr * row + C * META_BYTES), plain_buffered, links * Cr * back),
    }


def test_bench_ep_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ep.json"
    rc = main(["bench", "ep", "--nproc", str(W), "--tokens", str(T), "--dim", str(D), "--experts", str(E),
               "--top-k", str(K), "--repeats", "1", "--warmup", "0", "--json", str(out),
               "--payloads", "native,mxfp8"])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["config"]["dtype"] == "bf16" and record["config"]["factor"] == 2.0
    modes = record["modes"]
    names = ("exact", "exact+dedup", "buffered", "buffered+dedup")
    assert set(modes) == {*names, *(f"{n}:mxfp8" for n in names)}
    for name, row in modes.items():
        for key in ("dispatch_combine_ms", "raw_all_to_all_ms", "raw_data_all_to_all_ms"):
            assert row[key] > 0, (name, key)
        assert row["ratio"] == pytest.approx(row["dispatch_combine_ms"] / row["raw_all_to_all_ms"], rel=1e-12)
        assert row["ratio_data_only"] == pytest.approx(
            row["dispatch_combine_ms"] / row["raw_data_all_to_all_ms"], rel=1e-12)
        assert row["overflow"] == 0, name  # factor 2 over random routing: nothing dropped
    counts = W * W * (E // W + 1) * 8  # the count exchange: every rank sends L + 1 int64 to every rank
    # mxfp8 rows of width 16: the codes and one E8M0 byte (a short block); their gradients go back bf16
    bf16 = expected_bytes()
    for suffix, expected in (("", bf16), (":mxfp8", expected_bytes(D + 1))):
        for name, (sent, plain, back) in expected.items():
            row = modes[name + suffix]
            assert (row["bytes_sent"], row["bytes_sent_without_dedup"]) == (sent, plain), name + suffix
            # recompute under EP repeats the forward's trips (layers/recompute.py)
            assert (row["fwd_bytes"], row["bwd_bytes"]) == (counts + sent + back, bf16[name][0] + back), name
            assert row["recompute_extra_bytes"] == row["fwd_bytes"], name
            assert row["fwd_bwd_ms"] > 0 and row["recompute_fwd_bwd_ms"] > 0, name
            assert row["bytes_vs_first_payload"] == pytest.approx(sent / bf16[name][0], rel=1e-12), name
    # k=4 over 2 ranks of 4 experts: every token has >= 2 pairs on some rank, so de-dup sends less
    assert modes["exact+dedup"]["bytes_sent"] < modes["exact"]["bytes_sent"]


def test_bench_ep_shifting_skew_smoke(tmp_path: Path) -> None:
    out = tmp_path / "skew.json"
    rc = main(["bench", "ep", "--scenario", "shifting-skew", "--nproc", "2", "--tokens", "32", "--dim", "16",
               "--experts", "8", "--top-k", "2", "--steps", "3", "--check-every", "2", "--repeats", "1",
               "--warmup", "0", "--json", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    pol = record["policies"]
    for mode in ("buffered", "buffered+dedup"):
        assert pol[f"{mode} worst case"]["overflow_steps"] == 0  # the worst case never overflows
        assert pol[f"{mode} fixed 1.0"]["overflow_steps"] > 0  # a busiest link is above the mean
        for name in ("fixed 1.0", "fixed 1.5", "fixed 2.0", "worst case", "auto"):
            row = pol[f"{mode} {name}"]
            assert (row["bytes_retry_extra"] > 0) == (row["overflow_steps"] > 0), (mode, name)
            assert (row["bytes_spill_extra"] > 0) == (row["overflow_pairs"] > 0), (mode, name)
    timing = record["spill_vs_retry"]
    assert timing["pairs_overflowing"] > 0 and min(timing["spill_ms"], timing["retry_ms"], timing["fits_ms"]) > 0


def test_bench_ep_replicas_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rep.json"
    rc = main(["bench", "ep", "--scenario", "replicas", "--nproc", "4", "--tokens", "256", "--experts", "64",
               "--top-k", "8", "--steps", "2", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["numbering"] for r in rows] == ["hot experts first", "random"]
    for r in rows:  # the copies take load off the busiest rank; an expert whose owner is no busier
        # than every candidate rank gets no copy (ep_replicas.plan_replicas), so R = 4 places 1 to 4
        assert 1 <= r["replicas"] <= 4 and r["busiest_over_mean_replicated"] < r["busiest_over_mean_plain"], r
