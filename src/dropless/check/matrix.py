"""`python -m dropless.check.matrix` (or `dropless check-matrix`): the combination matrix.

    python -m dropless.check.matrix [--rows N|A-B|N,A-B] [--stages a,b] [--fast] [--no-ep] [--jobs N]
                                    [--json FILE] [--keep DIR] [--timeout S]

Prints the factors (factors.py), the number of rows and of pairs (covered / refused), checks every
refused pair through `dropless train` (refusals.py), then runs each row through the stages
(stages.py), one process per row (row.py), `--jobs` rows at a time, with a progress line per row;
then the table (one line per row: a column per stage with ok / ref(used) / FAIL, `-` where what the
stage needs is missing, then the row's non-default values) and each failure with its traceback.
After the covering rows come one row per Hugging Face family (factors.FAMILY_ROWS), numbered on.
Exits 1 on any FAIL, a refused pair not refused properly, or an allowed pair left uncovered.

Each row's process is forked from this one after it imported what the rows use (torch, the commands,
transformers, matplotlib: about 5 s of CPU a row would otherwise spend): a row still starts from
a clean state (nothing ran here but imports and config validation) and a crash is its own.

`--fast`: the one-process rows without a real compile (no EP launch, no inductor build).
`--no-ep`: leave out the rows that train at world 2. `--keep DIR`: keep the rows' folders there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..monitor import plots
from . import covering
from . import factors as fx
from .refusals import check_refused_pairs
from .row import RUNNING, run_row
from .runner import MODULES
from .stages import NAMES, selection

SHORT = {"ok": "ok", "refused": "ref", "FAIL": "FAIL", "-": "-", "": ""}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dropless check-matrix", description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="one row N, a range A-B, or a comma-separated list of them "
                   "(1-based, as the table shows)")
    p.add_argument("--stages", default=None, help=f"comma-separated subset of {','.join(NAMES)}")
    p.add_argument("--fast", action="store_true", help="one-process rows without a real compile")
    p.add_argument("--no-ep", action="store_true", help="leave out the rows that train at world 2")
    p.add_argument("--jobs", type=int, default=1, help="rows run in parallel processes")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--keep", type=Path, default=None, help="keep the rows' folders under this directory")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one row may take")
    p.add_argument("--seed", type=int, default=covering.SEED, help="the generator's seed")
    return p.parse_args(argv)


def row_numbers(text: str | None, n: int) -> list[int]:
    if text is None:
        return list(range(1, n + 1))
    numbers: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise ValueError(f"--rows {text!r}: expected N, A-B, or a comma-separated list of them") from None
        if not 1 <= lo <= hi <= n:
            raise ValueError(f"--rows {text!r}: rows are 1..{n}")
        numbers += [r for r in range(lo, hi + 1) if r not in numbers]
    return numbers


def is_ep(values: list[fx.Value]) -> bool:
    """A row that trains on several processes (expert parallel or pipeline stages)."""
    return any(o.split("=", 1)[0] in ("parallel.ep_size", "parallel.pp_size") and o.split("=", 1)[1] != "1"
               for v in values for o in v.overrides)


def compiles(values: list[fx.Value]) -> bool:
    labels = {(v.factor, v.label) for v in values}
    return any(a in labels and b in labels for a, b in fx.EXPENSIVE)


def spec_of(values: list[fx.Value], stages: list[str]) -> dict[str, Any]:
    """A row's spec for check/row.py: its overrides (a row that compiles but is not one of the
    EXPENSIVE pairs traces with aot_eager: factors.EXPENSIVE), stage options and stages."""
    overrides = covering.overrides(values)
    if any(o.startswith("train.compile=") for o in overrides) and not compiles(values):
        overrides = [*overrides, "train.compile_backend=aot_eager"]
    return {"overrides": overrides, "options": fx.stage_options(values), "stages": stages}


Rows = list[tuple[tuple[int, ...], str]]  # (a value index per factor, "" or "hf:FAMILY")


def all_rows(m: covering.Matrix) -> Rows:
    """The covering rows, then one row per Hugging Face family (factors.FAMILY_ROWS)."""
    return [(r, "") for r in m.rows] + [(fx.family_row(f), f"hf:{f}") for f in fx.FAMILY_ROWS]


def describe(m: covering.Matrix, rows: Rows, n: int) -> str:
    row, name = rows[n - 1]
    labels = " ".join(v.label for v in m.values(row) if v != m.factors[covering_index(m, v)][0])
    return " ".join(x for x in (f"[{name}]" if name else "", labels) if x) or "(defaults)"


def covering_index(m: covering.Matrix, v: fx.Value) -> int:
    return next(i for i, f in enumerate(m.factors) if f[0].factor == v.factor)


def header(m: covering.Matrix, problems: list[str]) -> list[str]:
    lines = [f"factors ({len(m.factors)}; the first value is the default):"]
    lines += [f"  {f[0].factor:<14} {', '.join(v.label for v in f)}" for f in m.factors]
    lines.append(f"left out (factors.LEFT_OUT says why): {'; '.join(fx.LEFT_OUT)}")
    missed, bad_rows = covering.coverage(m)
    lines.append(f"rows: {len(m.rows)} covering ({sum(is_ep(m.values(r)) for r in m.rows)} at world 2), then "
                 f"{len(fx.FAMILY_ROWS)} Hugging Face family rows; pairs: "
                 f"{len(m.allowed) + len(m.refused)}, {len(m.allowed) - len(missed)} covered, "
                 f"{len(m.refused)} refused by validation, {len(missed)} uncovered; rows refused whole: "
                 f"{len(bad_rows)}")
    lines.append("refused pairs (validation's message names a field of each):")
    lines += [f"  {a.factor}={a.label} + {b.factor}={b.label}: {msg}" for a, b, msg in refused_pairs(m)]
    lines.append(f"refused pairs through dropless train: {len(m.refused) - len(problems)} refused properly"
                 + (f", {len(problems)} problems:" if problems else ""))
    lines += [f"  {p}" for p in problems]
    return lines


def preload() -> None:
    """Import what every row imports, once, here: the rows are forked from this process (module note).
    Only imports: no tensor operation runs here before a fork (an OpenMP pool does not survive one)."""
    for name in ["dropless.check.row", *MODULES.values(), "dropless.runs.packed", "dropless.hf.mapping"]:
        importlib.import_module(name)
    try:
        plots.pyplot()
        import transformers  # noqa: F401  (its model classes load lazily: the three families here)
        from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: F401
        from transformers.models.mixtral import modeling_mixtral  # noqa: F401
        from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401
    except ImportError:
        pass  # the stages that need them say so


def _row_process(spec: dict[str, Any], folder: Path) -> None:
    """The forked child: its own session (a timeout kills its torchrun children too), its folder, its
    output in log.txt, one thread."""
    os.setsid()
    os.chdir(folder)
    fd = os.open(folder / "log.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(OMP_NUM_THREADS="1", DROPLESS_FILL_UNINITIALIZED="1")
    torch.set_num_threads(1)
    run_row(spec, folder, folder / "result.json")


def refused_pairs(m: covering.Matrix) -> list[tuple[fx.Value, fx.Value, str]]:
    return [(*m.pair_values(p), msg) for p, msg in sorted(m.refused.items())]


def run_rows(m: covering.Matrix, rows: Rows, numbers: list[int], stages: list[str], args: argparse.Namespace,
             root: Path) -> dict[int, dict[str, Any]]:
    """Each row in a process forked from this one, `args.jobs` at a time; a progress line as each ends."""
    fork = multiprocessing.get_context("fork")
    results: dict[int, dict[str, Any]] = {}
    pending, running = list(numbers), {}
    while pending or running:
        while pending and len(running) < max(1, args.jobs):
            n = pending.pop(0)
            values = m.values(rows[n - 1][0])
            folder = root / f"row-{n:03d}"
            folder.mkdir(parents=True)
            spec = spec_of(values, stages)
            (folder / "spec.json").write_text(json.dumps(spec, indent=1))
            proc = fork.Process(target=_row_process, args=(spec, folder), daemon=False)
            proc.start()
            running[n] = (proc, time.perf_counter(), folder)
        multiprocessing.connection.wait([p.sentinel for p, _, _ in running.values()], timeout=1.0)
        for n, (proc, t0, folder) in list(running.items()):
            late = time.perf_counter() - t0 > args.timeout
            if proc.is_alive() and not late:
                continue
            died = ""
            if late:
                os.killpg(proc.pid, signal.SIGKILL)  # the row's session: its torchrun children too
                died = f"the row ran past --timeout {args.timeout:.0f} s"
            proc.join()
            if not died and proc.exitcode:
                died = f"the row's process exited with status {proc.exitcode}"
            del running[n]
            results[n] = _collect(folder, stages, died, time.perf_counter() - t0)
            fails = [s for s in stages if results[n]["status"][s] == "FAIL"]
            print(f"[{len(results):>3}/{len(numbers)}] row {n:>3} {results[n]['wall_s']:>6.1f}s "
                  f"{'FAIL ' + ','.join(fails) if fails else 'ok':<24} {describe(m, rows, n)}", flush=True)
    return results


def _collect(folder: Path, stages: list[str], died: str, wall: float) -> dict[str, Any]:
    """The row's result.json, with the stage that was running marked as the failure if it died."""
    out = folder / "result.json"
    r = json.loads(out.read_text()) if out.exists() else {"status": {}, "notes": {}, "failures": {}, "seconds": {}}
    log = (folder / "log.txt").read_text(errors="replace") if (folder / "log.txt").exists() else ""
    for name in stages:
        if r["status"].get(name, RUNNING) == RUNNING and died:
            r["status"][name] = "FAIL"
            r["failures"][name] = {"what": died, "detail": log[-4000:]}
            died = ""
        r["status"].setdefault(name, "-")
    r["wall_s"] = round(wall, 1)
    return r


def table(m: covering.Matrix, rows: Rows, results: dict[int, dict[str, Any]], stages: list[str]) -> list[str]:
    width = {s: max(len(s), 4) for s in stages}
    lines = ["ok: worked, output checked; ref: refused with a ValueError naming the field, nothing written; "
             "-: not run (what it needs was not ok)",
             "row  " + " ".join(f"{s:<{width[s]}}" for s in stages) + "  values"]
    for n in sorted(results):
        st = results[n]["status"]
        lines.append(f"{n:>3}  " + " ".join(f"{SHORT[st.get(s, '')]:<{width[s]}}" for s in stages)
                     + f"  {describe(m, rows, n)}")
    return lines


def failures(m: covering.Matrix, rows: Rows, results: dict[int, dict[str, Any]]) -> list[str]:
    lines = []
    for n in sorted(results):
        for stage, f in results[n]["failures"].items():
            lines += ["", f"== row {n} stage {stage}: {f['what']}", f"   values: {describe(m, rows, n)}",
                      f"   set: {' '.join(covering.overrides(m.values(rows[n - 1][0])))}", f["detail"].rstrip()]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    m = covering.generate(args.seed)
    rows = all_rows(m)
    try:
        numbers = row_numbers(args.rows, len(rows))
        stages = selection(args.stages.split(",") if args.stages else NAMES)
    except ValueError as err:
        print(f"dropless check-matrix: error: {err}", file=sys.stderr)
        return 2
    numbers = [n for n in numbers if not ((args.no_ep or args.fast) and is_ep(m.values(rows[n - 1][0])))
               and not (args.fast and compiles(m.values(rows[n - 1][0])))]
    problems = check_refused_pairs(m)
    preload()
    print("\n".join(header(m, problems)), flush=True)
    print(f"running {len(numbers)} rows through {len(stages)} stages, {args.jobs} at a time", flush=True)
    root = Path(tempfile.mkdtemp(prefix="dropless-matrix-")) if args.keep is None else args.keep
    try:
        results = run_rows(m, rows, numbers, stages, args, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - t0
    print("\n".join(["", *table(m, rows, results, stages), *failures(m, rows, results)]))
    n_fail = sum(s == "FAIL" for r in results.values() for s in r["status"].values())
    missed, bad_rows = covering.coverage(m)
    print(f"\n{n_fail} failures in {sum(any(s == 'FAIL' for s in r['status'].values()) for r in results.values())} "
          f"of {len(results)} rows; {len(problems)} refusal problems; wall time {wall:.0f} s ({args.jobs} jobs)")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "factors": {f[0].factor: {v.label: list(v.overrides) for v in f} for f in m.factors},
            "pairs": {"allowed": len(m.allowed), "refused": len(m.refused), "uncovered": len(missed)},
            "refused_pairs": [[f"{a.factor}={a.label}", f"{b.factor}={b.label}", msg]
                              for a, b, msg in refused_pairs(m)],
            "refusal_problems": problems, "wall_s": round(wall, 1), "jobs": args.jobs, "stages": stages,
            "rows": [{"row": n, "values": describe(m, rows, n),
                      "overrides": covering.overrides(m.values(rows[n - 1][0])), **results[n]}
                     for n in sorted(results)],
        }, indent=1))
    return 1 if n_fail or problems or missed or bad_rows else 0


if __name__ == "__main__":
    sys.exit(main())
