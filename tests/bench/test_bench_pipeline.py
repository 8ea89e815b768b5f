"""`dropless bench pipeline`: the clock's accounting on a scripted schedule, the ideal bubble, the
default schedule list, the refusals before any process starts, and a 2-rank run end to end."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dropless.bench import pipeline as bench
from dropless.bench.pipeline_clock import StageClock

# a 4-block model small enough for a 2-rank run in seconds (3 MoE blocks after one dense block)
TOY = ["model.d_model=32", "model.n_heads=2", "model.d_ff_dense=64", "model.moe.num_experts=4",
       "model.moe.d_expert=32", "train.seq_len=16", "model.max_seq_len=16", "train.batch_size=4",
       "data.max_bytes=200000"]
SETS = [a for o in TOY for a in ("--set", o)]
F, B, W, LOSS, WAIT = 0.02, 0.02, 0.04, 0.02, 0.03  # seconds: forward, backward, weight, loss, a recv wait


class _Stage:
    def __init__(self, nested: bool = False) -> None:
        self.nested = nested

    def forward_one_chunk(self, i: int) -> None:
        time.sleep(F)

    def backward_one_chunk(self, i: int) -> None:
        time.sleep(B)
        if self.nested:  # a compute call inside another counts once
            self.backward_weight_one_chunk(i)

    def backward_weight_one_chunk(self, i: int) -> None:
        time.sleep(W)


class _Schedule:
    """Two stages on this rank, one micro-batch each: forward, loss, a wait, backward, weight backward."""

    def __init__(self) -> None:
        self._stages = [_Stage(), _Stage(nested=True)]
        self._loss_fn = lambda out, target: time.sleep(LOSS)

    def step(self) -> None:
        for i, stage in enumerate(self._stages):
            stage.forward_one_chunk(0)
            self._loss_fn(None, None)
            time.sleep(WAIT)
            stage.backward_one_chunk(0)
            if i == 0:
                stage.backward_weight_one_chunk(0)


def test_clock_counts_stage_compute_and_the_schedule_wall() -> None:
    schedule = _Schedule()
    clock = StageClock(SimpleNamespace(schedule=schedule))
    clock.start()
    time.sleep(0.05)  # outside the schedule: neither wall nor compute
    schedule.step()
    clock.stop()
    r = clock.readings[0]
    compute = 2 * (F + LOSS + B + W)
    # sleep overshoots by a few ms per call on a busy machine; leaving out any one scripted call (20 ms
    # or more, twice) or counting a nested one twice moves the sum by more than the 20 ms allowed
    assert r.compute_s == pytest.approx(compute, abs=0.02)
    assert r.wall_s == pytest.approx(compute + 2 * WAIT, abs=0.03)
    assert r.bubble == pytest.approx(2 * WAIT / (compute + 2 * WAIT), abs=0.08)
    assert r.compute_cpu_s < 0.5 * r.compute_s  # sleeping is wall time, not this thread's CPU time
    summary = clock.summary(0)
    assert summary["bubble"] == r.bubble and summary["sched_ms"] == pytest.approx(1e3 * r.wall_s)
    with pytest.raises(ValueError, match="--steps"):
        clock.summary(1)


def test_ideal_bubble() -> None:
    assert bench.Variant("1f1b", 4, 1, 8).ideal() == ("(p-1)/(m+p-1)", 3 / 11)
    assert bench.Variant("interleaved_1f1b", 4, 2, 8).ideal() == ("(p-1)/(vm+p-1)", 3 / 19)
    assert bench.Variant("pp1", 4).ideal() == ("-", 0.0)


def test_default_schedules_follow_the_layer_count() -> None:
    pairs, notes = bench._schedules(None, 2, 4)
    assert pairs == [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2)]
    assert notes == []
    pairs, notes = bench._schedules(None, 4, 4)  # 8 stages do not fit 4 blocks: zero bubble at 1 per rank
    assert pairs == [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1)]
    assert [n.split(" ")[0] for n in notes] == ["interleaved_1f1b", "zbv"]
    assert bench._schedules("zero_bubble:2,zbv", 2, 4)[0] == [("zero_bubble", 2), ("zbv", 2)]


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "1"], "--nproc=1: must be >= 2"),
    (["--nproc", "4", "--pp", "3"], "--pp=3: must be >= 2 and divide --nproc=4"),
    (["--steps", "0"], "--steps=0: must be >= 1"),
    (["--microbatches", "4,0"], "--microbatches='4,0': a comma-separated list of positive integers"),
    (["--schedules", "dualpipe"], "--schedules='dualpipe': 'dualpipe' is not one of"),
    (["--schedules", "zbv,zbv:2"], "--schedules='zbv,zbv:2': zbv with 2 stages per rank is named twice"),
    (["--schedules", "gpipe", "--microbatches", "3"],
     "--schedules gpipe:1 --microbatches 3: parallel.pp_microbatches=3: does not divide train.batch_size=4"),
    (["--nproc", "4", "--schedules", "1f1b", "--microbatches", "2"],
     "parallel.pp_microbatches=2: with parallel.pp_schedule='1f1b' and pp_size=4"),
    (["--schedules", "zbv:3"], "parallel.pp_schedule='zbv': with parallel.pp_stages_per_rank=3"),
    (["--schedules", "interleaved_1f1b:3"], "parallel.pp_size=2: with parallel.pp_stages_per_rank=3 that is 6 stages"),
    (["--nproc", "4", "--set", "train.batch_size=6", "--microbatches", "6"],
     "train.batch_size=6: the pp1 baseline splits it over --pp=4"),
    (["--set", "parallel.ep_size=2"], "parallel.ep_size=2 x --pp=2 does not divide --nproc=2"),
])
def test_bad_input_is_refused_before_any_process_starts(argv, message, capsys, monkeypatch) -> None:
    monkeypatch.setattr(bench.mp, "start_processes", lambda *a, **k: pytest.fail("a process started"))
    assert bench.main(["--nproc", "2", *SETS, *argv]) == 2
    assert message in capsys.readouterr().err


def test_two_ranks_end_to_end(tmp_path: Path, capsys) -> None:
    out = tmp_path / "pp.json"
    assert bench.main(["--nproc", "2", *SETS, "--schedules", "gpipe,zbv", "--microbatches", "2,4",
                       "--steps", "2", "--warmup", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert [(r["variant"], r["v"], r["m"]) for r in rows] == [
        ("gpipe", 1, 2), ("gpipe", 1, 4), ("zbv", 2, 2), ("zbv", 2, 4), ("pp1", None, None)]
    base = rows[-1]
    assert base["ratio"] == 1.0 and base["ideal"] == 0.0 and "bubble_mean" not in base and base["p"] == 1
    for r in rows[:-1]:
        p, v, m = r["p"], r["v"], r["m"]
        assert p == 2 and r["ideal"] == pytest.approx((p - 1) / (v * m + p - 1))
        assert r["ideal_formula"] == ("(p-1)/(m+p-1)" if v == 1 else "(p-1)/(vm+p-1)")
        assert len(r["bubble_ranks"]) == 2 and all(0 <= b <= 1 for b in r["bubble_ranks"])
        assert r["bubble_mean"] == pytest.approx(sum(r["bubble_ranks"]) / 2)
        assert r["bubble_max"] == max(r["bubble_ranks"])
        assert 0 < r["sched_ms"] <= r["step_ms"] and r["ratio"] == pytest.approx(r["step_ms"] / base["step_ms"])
        assert 0 < r["cpu_frac"] <= 1.0 + 1e-6  # thread CPU time cannot exceed wall time on one thread
    meta = record["meta"]
    assert (meta["nproc"], meta["pp"], meta["batch_size"], meta["threads"]) == (2, 2, 4, 1)
    assert "ideal_formula" in table and "pp1" in table
