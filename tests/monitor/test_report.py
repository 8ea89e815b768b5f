"""`dropless diagnose` on a synthetic run directory: the report and its plots are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dropless.cli import main as cli_main
from dropless.monitor.alarms import HealthMonitor


def synthetic_run(run_dir: Path, steps: int = 6, layers: int = 2, E: int = 4) -> None:
    mon = HealthMonitor(run_dir, echo=False)
    with (run_dir / "routing.jsonl").open("w") as fh:
        for step in range(0, steps * 10, 10):
            rows = []
            for i in range(layers):
                # layer 1 collapses onto expert 0 as training goes on
                hot = 8 + (step if i == 1 else 0)
                counts = [hot, 8, 8, 0 if i == 1 else 8]
                mean = sum(counts) / E
                rows.append({"counts": counts, "maxvio_local": max(counts) / mean - 0.5,
                             "maxvio_global": max(counts) / mean - 1, "maxvio_global_mean": 0.125 + i,
                             "tokens_min": min(counts),
                             "tokens_median": 8.0, "tokens_max": max(counts),
                             "rms_max_over_median": 1.5, "rms_min_over_median": 0.7, "entropy": 1.2,
                             "top1_top2": 1.8, "flip_bf16": 0.001, "flip_step": None if step == 0 else 0.05,
                             "dropped": 0, "overflow": None, "aux_loss": 1.02, "bias_abs_max": None, "top_k": 2})
            record = {"step": step, "layers": rows}
            fh.write(json.dumps(record) + "\n")
            mon.check(record)


def test_diagnose_writes_report_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install dropless[plots])")
    synthetic_run(tmp_path)
    assert cli_main(["diagnose", str(tmp_path)]) == 0
    out = tmp_path / "health"
    report = (out / "report.md").read_text()
    for name in ("load_L0.png", "load_L1.png", "maxvio.png", "rms.png", "flips.png", "router.png"):
        assert (out / name).stat().st_size > 1000, name
        assert f"]({name})" in report
    assert "dead_expert" in report and "collapse" in report  # layer 1's alarms, from health.jsonl
    assert "| 1 | " in report  # the per-layer table
    lines = report.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| layer |"))
    col = lines[at].split(" | ").index("maxvio_global_mean")
    # the per-layer table, after its header (the alarm table above it starts its rows with a step)
    assert [line.split(" | ")[col] for line in lines[at + 2:at + 4]] == ["0.125", "1.12"]


def test_diagnose_without_routing_record_fails_cleanly(tmp_path: Path, capsys) -> None:
    assert cli_main(["diagnose", str(tmp_path)]) == 1
    assert "routing.jsonl" in capsys.readouterr().out
