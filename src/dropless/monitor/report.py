"""`dropless diagnose RUN_DIR`: a Markdown routing-health report with PNG plots.

Reads RUN_DIR/routing.jsonl (one row per log interval) and RUN_DIR/health.jsonl (alarms), formats in
docs/monitoring.md; replays the alarm rules over routing.jsonl as well, so a run whose trainer did
not run the monitor still gets its alarms. The replay uses the run's own thresholds (the balance
alarms wait for its learning-rate warm-up, as in the trainer: replayed without it, the default run's
report listed `collapse` alarms from inside the warm-up that the trainer had rightly held back). Writes RUN_DIR/health/report.md and its PNGs. Without
matplotlib the report is written without plots and says what to install.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import atomic
from . import plots
from .alarms import HealthMonitor, read_alarms, thresholds_for_run


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "routing.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no routing record (the trainer writes it on log steps)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _draw(rows: list[dict], out: Path) -> list[tuple[str, str]]:
    """(caption, file name) of each plot."""
    n_layers = max(len(r["layers"]) for r in rows)
    made = []
    for i in range(n_layers):
        made.append((f"Layer {i}: expert load heatmap", plots.load_heatmap(rows, i, out / f"load_L{i}.png").name))
    made.append(("MaxVio, local (worst micro-batch), global (worst step) and the interval's mean global",
                 plots.curves(rows, ["maxvio_local", "maxvio_global", "maxvio_global_mean"], out / "maxvio.png",
                              "MaxVio").name))
    made.append(("Expert output RMS ratios to the median (log scale)",
                 plots.curves(rows, ["rms_max_over_median", "rms_min_over_median"], out / "rms.png",
                              "output RMS / median", log_y=True).name))
    made.append(("Selection flip rates: bf16 vs fp32, step to step",
                 plots.curves(rows, ["flip_bf16", "flip_step"], out / "flips.png", "flip rate").name))
    made.append(("Router entropy and top-1/top-2 ratio",
                 plots.curves(rows, ["entropy", "top1_top2"], out / "router.png", "router").name))
    return made


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    rows = read_rows(run_dir)
    out = out or run_dir / "health"
    out.mkdir(parents=True, exist_ok=True)
    logged = read_alarms(run_dir)
    replay = HealthMonitor(None, thresholds_for_run(run_dir), echo=False)
    replayed = [a for r in rows for a in replay.check(r)]
    seen = {(a["layer"], a["kind"]) for a in logged}
    alarms = logged + [vars(a) for a in replayed if (a.layer, a.kind) not in seen]
    nonfinite = sum(r.get("nonfinite_steps", 0) for r in rows)
    skipped = sum(r.get("skipped_steps", 0) for r in rows)
    lines = [f"# Routing health: {run_dir}", "",
             f"{len(rows)} log steps ({rows[0]['step']}..{rows[-1]['step']}), "
             f"{max(len(r['layers']) for r in rows)} MoE layers, {len(alarms)} alarms.", "",
             f"Skipped steps (not applied, left out of the counts): {skipped}, of which {nonfinite} for a "
             "non-finite loss or gradient norm.", "", "## Alarms", ""]
    if alarms:
        lines += ["| step | layer | expert | kind | metric | value | threshold | likely cause | what to do |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for a in sorted(alarms, key=lambda a: (a["step"], -1 if a["layer"] is None else a["layer"])):
            lines.append(f"| {a['step']} | {_fmt(a['layer'])} | {_fmt(a.get('expert'))} | {a['kind']} | {a['metric']} "
                         f"| {_fmt(a['value'])} | {_fmt(a['threshold'])} | {a['cause']} | {a['action']} |")
    else:
        lines.append("None.")
    keys = ["maxvio_local", "maxvio_global", "maxvio_global_mean", "tokens_min", "tokens_max", "rms_max_over_median",
            "rms_min_over_median", "entropy", "top1_top2", "flip_bf16", "flip_step", "dropped", "overflow"]
    lines += ["", f"## Last log step ({rows[-1]['step']})", "", "| layer | " + " | ".join(keys) + " |",
              "|---" * (len(keys) + 1) + "|"]
    for i, row in enumerate(rows[-1]["layers"]):
        lines.append(f"| {i} | " + " | ".join(_fmt(row.get(k)) for k in keys) + " |")
    lines += ["", "## Plots", ""]
    try:
        for caption, name in _draw(rows, out):
            lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    except ImportError as err:
        lines.append(f"Plots skipped: {err}")
        print(f"dropless diagnose: {err}")
    path = out / "report.md"
    atomic.write_text(path, "\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dropless diagnose", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory holding routing.jsonl (and health.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/health)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.run_dir, args.out)
    except FileNotFoundError as err:
        print(f"dropless diagnose: {err}")
        return 1
    print(f"dropless diagnose: wrote {path}")
    return 0
