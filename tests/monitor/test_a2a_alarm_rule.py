"""The `a2a_slow` rule on made-up routing rows: the baseline is the median of the rows after the
first (step 0 pays first-call setup), nothing fires while it forms, a row above ratio x baseline
fires once, a row at it does not; a replay (resume, `dropless diagnose`) rebuilds the same baseline."""

from __future__ import annotations

import pytest

from dropless.config import ParallelConfig
from dropless.monitor.alarms import AlarmThresholds, HealthMonitor


def _rows(ms: list[float]) -> list[dict]:
    return [{"step": i, "layers": [], "a2a_ms": m} for i, m in enumerate(ms)]


def _fired(ms: list[float], ratio: float = 1.5) -> list[tuple[int, float]]:
    mon = HealthMonitor(None, AlarmThresholds(a2a_slow_ratio=ratio), echo=False)
    return [(a.step, a.value) for row in _rows(ms) for a in mon.check(row) if a.kind == "a2a_slow"]


def test_a2a_slow_fires_above_the_baseline_only() -> None:
    base = [500.0, 10.0, 12.0, 9.0, 11.0, 10.0]  # row 0: setup; baseline = median(10, 12, 9, 11, 10) = 10
    assert _fired(base + [15.0, 14.9, 10.0]) == []  # 1.5 x 10 = 15 is not above
    assert _fired(base + [10.0, 15.1, 30.0]) == [(7, pytest.approx(1.51))]  # once per run
    assert _fired([10.0, 10.0, 10.0, 30.0, 10.0, 10.0]) == []  # a spike inside the baseline window
    assert _fired(base + [25.0], ratio=3.0) == []
    # a slow creep past the margin still fires: the baseline is the run's early rows, it does not follow
    assert _fired(base + [14.0, 14.5, 14.5, 14.9, 14.9, 16.0]) == [(11, pytest.approx(1.6))]
    assert _fired([1.0] * 3) == []  # too few rows for a baseline


def test_rows_without_a2a_time_are_ignored() -> None:
    mon = HealthMonitor(None, echo=False)
    assert [a for a in mon.check({"step": 0, "layers": []}) if a.kind == "a2a_slow"] == []


@pytest.mark.parametrize("field,value", [("check_collectives", 1), ("collective_timeout_s", -1.0),
                                         ("collective_timeout_s", True), ("a2a_alarm_ratio", 1.0),
                                         ("a2a_alarm_ratio", "2")])
def test_watch_fields_are_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"parallel.{field}="):
        ParallelConfig(**{field: value})
