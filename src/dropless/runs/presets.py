"""Presets: the TOML configs shipped inside the package (`tiny`, the default; `dense`; the planner's
`plan/...` recipes), found by name or as a file path (`--config NAME|FILE`)."""

from __future__ import annotations

from pathlib import Path

PRESETS = Path(__file__).resolve().parent.parent / "presets"
DEFAULT_PRESET = "tiny"


def preset_path(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"--config {name}: no such file")
        return path
    candidate = PRESETS / f"{name}.toml"
    if not candidate.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS.glob("*.toml")))
        raise ValueError(f"--config {name!r}: not a file and not a preset (presets: {known})")
    return candidate
