"""One row of the matrix through its stages, in a process of its own:

    python -m dropless.check.row SPEC.json RESULT.json

SPEC holds the row's overrides (after factors.BASE), its stage options and the stages to run; the
row's folder is the working directory. RESULT is rewritten after every stage, so a process that dies
(a signal, a hard crash in a kernel) still leaves the stages it finished; matrix.py marks the stage
that was running as the failure. One process per row: no state (seeds, compiled graphs, process
groups, threads) carries from one row to the next, and one row's crash is that row's.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ..config import apply_overrides
from . import factors as fx
from .covering import base_config
from .runner import Failed, Refused, Skipped
from .stages import BY_NAME, Ctx

RUNNING = "running"


def run_row(spec: dict[str, Any], root: Path, result_path: Path | None = None) -> dict[str, Any]:
    cfg = apply_overrides(base_config(), spec["overrides"])
    ctx = Ctx(cfg, fx.BASE + spec["overrides"], root, spec.get("options", {}))
    result: dict[str, Any] = {"status": {}, "notes": ctx.notes, "failures": {}, "seconds": {}}
    for name in spec["stages"]:
        stage = BY_NAME[name]
        if any(result["status"].get(n) != "ok" for n in stage.needs):
            result["status"][name] = "-"
            continue
        result["status"][name] = RUNNING
        _write(result_path, result)
        t0 = time.perf_counter()
        try:
            stage.run(ctx)
            status = "ok"
        except Refused as r:
            status = "refused"
            ctx.notes.setdefault(name, []).append(f"refused: {r}")
        except Skipped as s:
            status = "-"
            ctx.notes.setdefault(name, []).append(str(s))
        except Failed as f:
            status = "FAIL"
            result["failures"][name] = {"what": str(f), "detail": f.detail}
        except Exception as e:  # noqa: BLE001  (a check that raises is the stage's failure, shown whole)
            status = "FAIL"
            result["failures"][name] = {"what": f"{type(e).__name__}: {e}", "detail": traceback.format_exc()}
        result["status"][name] = status
        result["seconds"][name] = round(time.perf_counter() - t0, 2)
        _write(result_path, result)
    return result


def _write(path: Path | None, result: dict[str, Any]) -> None:
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec, out = json.loads(Path(argv[0]).read_text()), Path(argv[1])
    torch.set_num_threads(1)  # rows run side by side (--jobs), each on one core
    run_row(spec, Path(os.getcwd()), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
