"""`dropless train`: build the config (preset + overrides), pick the run directory, train.

    dropless train [--config NAME|FILE] [--set a.b=value ...] [--run-dir DIR] [--resume] [--nproc N]

Several processes: `--nproc N` re-launches the same command under torchrun
(`python -m torch.distributed.run --standalone --nproc-per-node N -m dropless.train ...`), with the run
directory chosen once, here; `torchrun ... -m dropless.train ...` directly works as well (rank 0 picks
the directory and tells the others). torchrun's agent watches the workers: when one dies, it stops the
others and exits non-zero with the failing rank's error, and `--resume` continues from the last
complete checkpoint (a save interrupted by the failure is never published).

`--config` takes a preset name (`tiny`, `dense`, ... from dropless/presets/) or a TOML file. Without
`--run-dir` a new folder `runs/<preset>-<time>` is made; `--resume` without `--run-dir` continues the
newest `runs/<preset>-*` that has a complete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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
    p.add_argument("--nproc", type=int, default=0,
                   help="processes to launch with torchrun (default: one process, no launcher)")
    return p


def launch(args: argparse.Namespace, argv: list[str], run_dir: Path) -> int:
    """Re-run this command under torchrun with N processes; returns torchrun's exit status."""
    rest, skip = [], False
    for a in argv:  # drop --nproc (and its value) and any --run-dir; the chosen one is passed
        if skip:
            skip = False
        elif a in ("--nproc", "--run-dir"):
            skip = True
        elif not a.startswith(("--nproc=", "--run-dir=")):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "dropless.train", *rest, "--run-dir", str(run_dir)]
    print(f"launching: {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, env=os.environ.copy()).returncode


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
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.nproc < 0:
        print(f"dropless train: error: --nproc {args.nproc}: must be >= 1", file=sys.stderr)
        return 2
    try:
        path = preset_path(args.config)
        cfg = load_config(path, args.overrides)
        if args.nproc and not under_torchrun:
            return launch(args, argv, choose_run_dir(args, path.stem))
        from ..distributed.parallelize import init_distributed
        from .device import resolve_device

        distributed = init_distributed(resolve_device(cfg.train.device)[0])
        run_dir = choose_run_dir(args, path.stem) if not distributed or _rank() == 0 else None
        if distributed:
            run_dir = _broadcast(run_dir)
        if not args.resume and ckpt.latest_checkpoint(run_dir) is not None:
            raise ValueError(f"--run-dir {run_dir} already holds checkpoints: pass --resume, or choose another")
        from .loop import Trainer

        trainer = Trainer(cfg, run_dir, resume=args.resume)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless train: error: {err}", file=sys.stderr)
        return 2
    if trainer.is_main:
        print(f"run directory: {run_dir}")
    summary = trainer.fit()
    if trainer.is_main:
        print(json.dumps(summary, indent=2))
    if trainer.distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _broadcast(run_dir: Path | None) -> Path:
    import torch.distributed as dist

    box = [str(run_dir) if run_dir is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


if __name__ == "__main__":
    sys.exit(main())
