"""`dropless bench quality`: the rows it writes are the runs' own figures, and bad input writes nothing."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from dropless.bench import quality as bench
from dropless.config import load_config
from dropless.model import MoEModel
from dropless.runs.presets import preset_path

SMALL = ["model.d_model=32", "model.n_heads=2", "model.max_seq_len=32", "model.d_ff_dense=64",
         "model.moe.d_expert=32", "train.batch_size=2", "train.seq_len=32", "train.eval_batches=1",
         "data.max_bytes=100000", "log.progress=false"]


def test_bench_quality_rows(tmp_path: Path, capsys) -> None:
    out, js = tmp_path / "runs", tmp_path / "q.json"
    argv = ["--steps", "2", "--variants", "dense,fine", "--out", str(out), "--json", str(js)]
    for item in SMALL:
        argv += ["--set", item]
    assert bench.main(argv) == 0
    rows = json.loads(js.read_text())
    assert [r["variant"] for r in rows] == ["dense", "fine"]
    for r in rows:
        run = out / r["variant"]
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert r["val_loss"] == [m["val_loss"] for m in metrics if "val_loss" in m][-1]
        cfg = load_config(run / "config.toml")
        assert cfg.train.steps == 2
        counts = MoEModel(cfg.model).num_params()
        assert (r["active_M"], r["total_M"]) == (counts["active"] / 1e6, counts["total"] / 1e6)
    dense, fine = (load_config(out / v / "config.toml").model for v in ("dense", "fine"))
    E = load_config(preset_path("tiny")).model.moe.num_experts
    # the dense row is all dense at the MoE's active width; fine-grained doubles E and k, halves f
    assert dense.n_dense_layers == dense.n_layers and dense.d_ff_dense == 2 * 32
    assert (fine.moe.num_experts, fine.moe.top_k, fine.moe.d_expert) == (2 * E, 4, 16)
    assert rows[0]["maxvio_global"] is None and rows[1]["maxvio_global"] > 0
    # equal active parameters up to the routers (3 MoE layers of a [d, 2E] router)
    assert round(1e6 * (rows[1]["active_M"] - rows[0]["active_M"])) == 3 * 32 * 2 * E
    routing = [json.loads(line) for line in (out / "fine" / "routing.jsonl").read_text().splitlines()]
    worst = [max(max(layer["counts"]) / statistics.mean(layer["counts"]) - 1 for layer in row["layers"])
             for row in routing[-5:]]
    assert rows[1]["maxvio_global"] == pytest.approx(statistics.mean(worst), rel=1e-6)
    summed = [[sum(c) for c in zip(*(row["layers"][i]["counts"] for row in routing[-5:]))]
              for i in range(len(routing[0]["layers"]))]
    assert rows[1]["maxvio_span"] == pytest.approx(max(max(c) / statistics.mean(c) - 1 for c in summed))
    assert rows[0]["maxvio_span"] is None
    # one-step log intervals here: each interval's mean of the worst layer is its worst step
    assert all(row["maxvio_worst_mean"] == pytest.approx(
        max(layer["maxvio_global"] for layer in row["layers"])) for row in routing)
    assert rows[1]["maxvio_mean"] == pytest.approx(rows[1]["maxvio_global"]) and rows[0]["maxvio_mean"] is None
    assert rows[1]["first_vio_0.5"] == next((row["step"] for row in routing
                                             if max(layer["maxvio_global"] for layer in row["layers"]) <= 0.5), None)
    printed = capsys.readouterr().out.splitlines()  # the trainer prints its placement line first
    table = printed[next(i for i, line in enumerate(printed) if line.startswith("variant")):]
    assert table[0].split()[:3] == ["variant", "val_loss", "vs_dense"]
    assert [line.split()[0] for line in table[2:4]] == ["dense", "fine"]
    assert table[2].split()[1] == f"{rows[0]['val_loss']:.4f}" and table[2].split()[2] == "+0.00%"
    assert table[3].split()[2] == f"{100 * (rows[1]['val_loss'] / rows[0]['val_loss'] - 1):+.2f}%"
    # --table: the same table again from the saved rows, no training
    assert bench.main(["--table", str(js)]) == 0
    assert capsys.readouterr().out.splitlines() == table[:4]


def test_tiny_dense_row_is_the_dense_preset() -> None:
    """The derived dense row has the dense preset's parameters ('same active parameters')."""
    tiny = load_config(preset_path("tiny"))
    dense = load_config(preset_path("tiny"), bench.variants(tiny)["dense"])
    preset = load_config(preset_path("dense"))
    assert MoEModel(dense.model).num_params() == MoEModel(preset.model).num_params()
    assert MoEModel(tiny.model).num_params()["active"] == pytest.approx(
        MoEModel(preset.model).num_params()["active"], rel=0.01)


def test_bench_quality_bad_variant(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dropless.cli", "bench", "quality", "--steps", "2",
                           "--variants", "moe,nope", "--out", str(tmp_path / "runs"), "--json",
                           str(tmp_path / "q.json")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("dropless bench quality: error:") and "'nope'" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_summarize_last_rows(tmp_path: Path) -> None:
    """MaxVio: worst layer of each of the last 5 routing rows, averaged; the span MaxVio from the last 5
    rows' counts summed per layer (worst layer); the rest from the summary."""
    layers = lambda a, b, ca, cb: [{"maxvio_global": a, "counts": ca},  # noqa: E731
                                   {"maxvio_global": b, "counts": cb}]
    rows = [{"step": i, "layers": layers(10.0 * i + 0.6, 0.5, [100, 0, 0], [0, 0, 100])} for i in range(5)]
    # both layers swap their busiest expert from row to row, so the sums are flatter than any row
    swing = [[40, 20, 30], [20, 40, 30]]
    rows += [{"step": 5 + i, "layers": layers(0.1 * i, 0.25, [45, 20, 25] if i % 2 else [20, 45, 25],
                                              swing[i % 2])} for i in range(5)]
    (tmp_path / "routing.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"final_val_loss": 1.5, "params_active": 2_000_000, "params_total": 5_000_000, "tokens_per_s": 9.0}
    got = bench.summarize(tmp_path, summary)
    assert got["maxvio_global"] == pytest.approx(statistics.mean([0.25, 0.25, 0.25, 0.3, 0.4]))
    # the last 5 rows sum to [150, 175, 125] in layer 0 and [160, 140, 150] in layer 1 (means 150)
    assert got["maxvio_span"] == pytest.approx(175 / 150 - 1)
    # the first row whose worst layer is at most 0.5 (both layers count): step 5
    assert got["first_vio_0.5"] == 5
    assert (got["val_loss"], got["active_M"], got["total_M"], got["tokens_per_s"]) == (1.5, 2.0, 5.0, 9.0)
    # rows from before the monitor kept the interval mean: no mean columns
    assert got["maxvio_mean"] is None and "first_mean_0.5" not in got
    # with the mean: first_mean_0.5 reads it (step 3, before any interval's worst step was <= 0.5)
    means = [2.0, 0.9, 0.6, 0.45, 0.7, 0.2, 0.3, 0.1, 0.2, 0.3]
    (tmp_path / "routing.jsonl").write_text("".join(json.dumps({**r, "maxvio_worst_mean": m}) + "\n"
                                                    for r, m in zip(rows, means)))
    got = bench.summarize(tmp_path, summary)
    assert got["first_mean_0.5"] == 3 and got["first_vio_0.5"] == 5
    assert got["maxvio_mean"] == pytest.approx(statistics.mean(means[-5:]))
    (tmp_path / "routing.jsonl").write_text("".join(json.dumps({**r, "maxvio_worst_mean": 0.6}) + "\n"
                                                    for r in rows))
    assert bench.summarize(tmp_path, summary)["first_mean_0.5"] is None


def test_rows_start_from_the_plain_moe_whatever_knob_the_preset_turns_on() -> None:
    """A preset that turns a quality knob on (identity experts, MTP) still gets a knob-free `moe` row,
    each knob row differs from it by that knob alone, and `default` is the preset as it is."""
    knobs = ["model.moe.n_identity_experts=2", "model.mtp_depth=1"]
    preset = load_config(preset_path("tiny"), knobs)
    rows = bench.variants(preset)
    cfg = {v: load_config(preset_path("tiny"), knobs + rows[v]).model for v in ("default", "moe", "identity", "mtp1")}
    assert (cfg["default"].moe.n_identity_experts, cfg["default"].mtp_depth) == (2, 1)
    assert (cfg["moe"].moe.n_identity_experts, cfg["moe"].mtp_depth) == (0, 0)
    assert cfg["moe"] == load_config(preset_path("tiny"), bench.KNOBS_OFF).model
    assert (cfg["identity"].moe.n_identity_experts, cfg["identity"].mtp_depth) == (preset.model.moe.num_experts // 4, 0)
    assert (cfg["mtp1"].moe.n_identity_experts, cfg["mtp1"].mtp_depth) == (0, 1)


def test_bench_quality_seeds(tmp_path: Path, capsys) -> None:
    """--seeds: every variant once per seed (seed-major), each run's config carries its seed, and the
    table shows each variant's mean and range with vs_dense paired per seed."""
    out, js = tmp_path / "runs", tmp_path / "q.json"
    argv = ["--steps", "2", "--variants", "dense,moe", "--seeds", "7,8", "--out", str(out), "--json", str(js)]
    for item in SMALL:
        argv += ["--set", item]
    assert bench.main(argv) == 0
    rows = json.loads(js.read_text())
    assert [(r["variant"], r["seed"]) for r in rows] == [("dense", 7), ("moe", 7), ("dense", 8), ("moe", 8)]
    for r in rows:
        run = out / f"{r['variant']}-s{r['seed']}"
        assert load_config(run / "config.toml").train.seed == r["seed"]
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert r["val_loss"] == [m["val_loss"] for m in metrics if "val_loss" in m][-1]
    assert rows[0]["val_loss"] != rows[2]["val_loss"]  # the seed reaches the run
    printed = capsys.readouterr().out.splitlines()
    table = printed[next(i for i, line in enumerate(printed) if line.startswith("variant")):]
    assert table[0].split() == bench.SEED_COLUMNS
    moe = table[3].split()
    vals = [r["val_loss"] for r in rows if r["variant"] == "moe"]
    rel = [100 * (rows[i + 1]["val_loss"] / rows[i]["val_loss"] - 1) for i in (0, 2)]
    assert moe[:5] == ["moe", "2", f"{statistics.mean(vals):.4f}", f"{min(vals):.4f}..{max(vals):.4f}",
                       f"{statistics.mean(rel):+.2f}%"]
    assert moe[5] == f"{min(rel):+.2f}..{max(rel):+.2f}%"


def test_table_pairs_each_run_with_the_dense_run_of_its_seed() -> None:
    """vs_dense is the mean of per-seed ratios, not the ratio of means (here +0.00%, not +3.33%), and a
    run with no dense run of its seed is left out of the ratio."""
    row = lambda v, seed, val: {"variant": v, "seed": seed, "val_loss": val, "active_M": 1.0,  # noqa: E731
                                "total_M": 2.0, "tokens_per_s": 10.0, "maxvio_global": None, "wall_s": 1.0}
    rows = [row("dense", 1, 1.0), row("dense", 2, 2.0), row("moe", 1, 0.9), row("moe", 2, 2.2), row("moe", 3, 5.0)]
    lines = bench.table(rows).splitlines()
    moe = lines[3].split()
    assert moe[:6] == ["moe", "3", f"{(0.9 + 2.2 + 5.0) / 3:.4f}", "0.9000..5.0000", "+0.00%", "-10.00..+10.00%"]
    single = bench.table([{**r, "seed": None} for r in rows[:1]] + [{**rows[2], "seed": None}]).splitlines()
    assert single[0].split() == bench.COLUMNS and single[3].split()[2] == "-10.00%"


@pytest.mark.parametrize("text", ["", "1,x", "3,3", "-1"])
def test_bench_quality_bad_seeds(text: str) -> None:
    with pytest.raises(ValueError, match="--seeds"):
        bench.parse_seeds(text)


def test_table_shows_each_seeds_first_step_at_maxvio_half() -> None:
    """first_vio_0.5 is listed per seed in run order ("never": not within the run); rows saved before
    the column existed show nothing rather than "never"; the span MaxVio averages over seeds."""
    row = lambda seed, first, span: {"variant": "moe", "seed": seed, "val_loss": 1.0, "active_M": 1.0,  # noqa: E731
                                     "total_M": 2.0, "tokens_per_s": 10.0, "maxvio_global": 0.6,
                                     "maxvio_span": span, "first_vio_0.5": first, "wall_s": 1.0}
    cols = bench.SEED_COLUMNS
    line = bench.table([row(1, 409, 0.1), row(2, None, 0.3)]).splitlines()[2].split()
    assert line[cols.index("first_vio_0.5")] == "409/never" and line[cols.index("maxvio_span")] == "0.20"
    old = {k: v for k, v in row(3, 5, 0.1).items() if k not in ("first_vio_0.5", "maxvio_span")}
    line = bench.table([row(1, 409, 0.1), old]).splitlines()[2].split()
    assert line[cols.index("maxvio_span")] == "0.10" and line[cols.index("first_vio_0.5")] == "-"
    assert line[cols.index("first_mean_0.5")] == "-" and line[cols.index("maxvio_mean")] == "-"
    mean = lambda seed, first, m: {**row(seed, 409, 0.1), "first_mean_0.5": first, "maxvio_mean": m}  # noqa: E731
    line = bench.table([mean(1, 209, 0.3), mean(2, None, 0.5)]).splitlines()[2].split()
    assert line[cols.index("first_mean_0.5")] == "209/never" and line[cols.index("maxvio_mean")] == "0.40"


def test_every_balancing_row_loads_and_the_warm_and_damped_rows_set_their_rules() -> None:
    """Each `bal_<method>` row is a valid config of the preset (a bad override would fail the bench
    only when its turn came, hours in); the two rules that met the balancing targets are what they say."""
    tiny = load_config(preset_path("tiny"))
    rows = bench.variants(tiny)
    cfgs = {n: load_config(preset_path("tiny"), sets).model.moe for n, sets in rows.items() if n.startswith("bal_")}
    assert len(cfgs) >= 17
    warm, half = cfgs["bal_bias_adaptive_warm"], cfgs["bal_quantile_half"]
    assert (warm.balance.aux_loss_coeff, warm.balance.bias_update_rule, warm.balance.bias_update_rate,
            warm.balance.bias_warm_start_steps, warm.router.use_expert_bias) == (0.0, "adaptive", 1e-3, 50, True)
    assert (half.balance.aux_loss_coeff, half.balance.quantile_balance, half.balance.quantile_momentum,
            half.router.use_expert_bias) == (0.0, True, 0.5, True)
