"""`dropless train`: build the config (preset + overrides), pick the run directory, train.

    dropless train [--config NAME|FILE] [--set a.b=value ...] [--run-dir DIR] [--resume]

`--config` takes a preset name (`tiny`, `dense`, ... from dropless/presets/) or a TOML file. Without
`--run-dir` a new folder `runs/<preset>-<time>` is made; `--resume` without `--run-dir` continues the
newest `runs/<preset>-*` that has a complete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..config import load_config
from . import checkpoint as ckpt

PRESETS = Path(__file__).resolve().parent.parent / "presets"


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dropless train", description="Train an MoE language model.")
    p.add_argument("--config", default="tiny", help="preset name or TOML file (default: tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value",
                   help="override a config field by dotted name (repeatable)")
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/<preset>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint")
    return p


def choose_run_dir(args: argparse.Namespace, preset: str) -> Path:
    if args.run_dir:
        return Path(args.run_dir)
    if args.resume:
        candidates = sorted((p for p in Path("runs").glob(f"{preset}-*")
                             if ckpt.latest_checkpoint(p) is not None), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise FileNotFoundError(f"--resume: no runs/{preset}-* folder with a complete checkpoint")
        return candidates[-1]
    return Path("runs") / f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        path = preset_path(args.config)
        cfg = load_config(path, args.overrides)
        run_dir = choose_run_dir(args, path.stem)
        if not args.resume and ckpt.latest_checkpoint(run_dir) is not None:
            raise ValueError(f"--run-dir {run_dir} already holds checkpoints: pass --resume, or choose another")
        from .loop import Trainer

        trainer = Trainer(cfg, run_dir, resume=args.resume)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless train: error: {err}", file=sys.stderr)
        return 2
    print(f"run directory: {run_dir}")
    summary = trainer.fit()
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
