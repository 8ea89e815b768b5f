"""The refused pairs, checked through the command a user would type: `dropless train` with the two
values set must exit with a ValueError naming a field of each value, before it writes anything (the
run directory must not exist afterwards)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from . import factors as fx
from .covering import Matrix, overrides, refusal_names_both
from .runner import Failed, Refused, invoke
from .stages import sets


def check_refused_pairs(m: Matrix) -> list[str]:
    """Problems, one line each (empty: every refused pair is refused properly)."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="dropless-refusals-") as tmp:
        root = Path(tmp)
        for pair, message in sorted(m.refused.items()):
            a, b = m.pair_values(pair)
            what = f"{a.factor}={a.label} + {b.factor}={b.label}"
            if not refusal_names_both(message, a, b):
                problems.append(f"{what}: validation's message names {_fields(a)} or {_fields(b)} not both: {message}")
            run = root / "run"
            try:
                invoke("train", ["--run-dir", str(run), *sets(fx.BASE + overrides([a, b]))], root)
                problems.append(f"{what}: dropless train accepted it")
            except Refused as r:
                if str(r) != message:
                    problems.append(f"{what}: dropless train refused with {r!s}, validation with {message}")
            except Failed as f:
                problems.append(f"{what}: {f}")
            if run.exists():
                problems.append(f"{what}: dropless train created {run.name}/ before refusing")
    return problems


def _fields(v: fx.Value) -> str:
    return "/".join(v.fields)
