"""`dropless bench a2a` runs end to end on a tiny world, writes the documented JSON keys with
bandwidths that follow from its own times and sizes, and refuses bad flags with exit 2 and no file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dropless.bench.a2a import parse_size, rows_from_times
from dropless.cli import main


def test_bench_a2a_smoke(tmp_path: Path) -> None:
    out = tmp_path / "a2a.json"
    assert main(["bench", "a2a", "--nproc", "2", "--sizes", "4K", "64K", "--repeats", "2", "--warmup", "1",
                 "--device", "cpu", "--overlap", "16", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["config"]["backend"] == "gloo" and record["config"]["bytes"] == [4096, 65536]
    rows = record["sizes"]
    assert [r["bytes"] for r in rows] == [4096, 65536]
    for r in rows:
        assert r["a2a_ms"] > 0 and r["all_reduce_ms"] > 0
        assert r["a2a_over_all_reduce_time"] == pytest.approx(r["a2a_ms"] / r["all_reduce_ms"], rel=1e-12)
        # nccl-tests convention at N = 2: all-to-all busbw = algbw / 2, all-reduce busbw = algbw
        assert r["a2a_busbw_gbs"] == pytest.approx(r["bytes"] / r["a2a_ms"] / 1e6 / 2, rel=1e-12)
        assert r["all_reduce_busbw_gbs"] == pytest.approx(r["bytes"] / r["all_reduce_ms"] / 1e6, rel=1e-12)
        assert r["mlp_ms"] > 0 and r["sequential_ms"] > 0 and r["overlapped_ms"] > 0  # --overlap
        assert r["hidden"] == pytest.approx((r["sequential_ms"] - r["overlapped_ms"]) / min(r["a2a_ms"], r["mlp_ms"]))
    assert list(tmp_path.iterdir()) == [out]  # no temp file left behind


def test_bandwidth_convention() -> None:
    """N = 4, 1 MB in 1 ms both ways: algbw 1.048576 GB/s; busbw x 3/4 (all-to-all), x 3/2 (all-reduce)."""
    (row,) = rows_from_times({"1048576/a2a": 1.0, "1048576/all_reduce": 1.0}, [1 << 20], 4)
    assert row["a2a_busbw_gbs"] == pytest.approx(1.048576 * 0.75)
    assert row["all_reduce_busbw_gbs"] == pytest.approx(1.048576 * 1.5)
    assert row["busbw_ratio"] == pytest.approx(0.5)


@pytest.mark.parametrize("argv,needle", [
    (["--nproc", "1"], "--nproc 1"),
    (["--sizes", "12K", "--nproc", "5"], "--sizes 12K"),  # 12288 bytes do not split into fp32 blocks over 5
    (["--sizes", "10"], "--sizes 10"),
    (["--sizes", "0K"], "--sizes '0K'"),
    (["--sizes", "lots"], "--sizes 'lots'"),
    (["--repeats", "0"], "--repeats 0"),
    (["--overlap", "-1"], "--overlap -1"),
    (["--sizes", "64", "--overlap", "32"], "--sizes 64: below one row"),
])
def test_bench_a2a_refuses_bad_flags(tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str],
                                     needle: str) -> None:
    out = tmp_path / "a2a.json"
    assert main(["bench", "a2a", *argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless bench a2a: error: ") and needle in err, err
    assert not out.exists()


def test_parse_size() -> None:
    assert [parse_size(s) for s in ("4096", "64K", "1M", "2g", "16MiB")] == [4096, 65536, 1 << 20, 2 << 30, 16 << 20]
