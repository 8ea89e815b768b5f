"""`dropless import-hf DIR --out RUN_DIR [--nproc N] [--set a.b=value ...]`: the command, in one
process (hf/import_hf.py `write_run`) or at world N.

Each of the N processes (relaunched under torchrun, gloo on the CPU) builds the model on the meta
device, parallelises it as the trainer would (EP over E ranks, FSDP2 over the rest:
distributed/parallelize.py), allocates only its own shards and reads only their slices from the
safetensors files (hf/shard_load.py); the step-0 checkpoint is then written collectively in the
trainer's one format (runs/dist_checkpoint.py), which resumes at any world size. So the largest
process holds about 1/N of the model, where the one-process import holds all of it.

Nothing is left on failure: every rank writes into one hidden sibling of RUN_DIR, which rank 0
renames into place after the last barrier (and removes on an error before it). The checks of the
one-process import (hf/import_hf.py: the folder, the config, the tokenizer) run before N processes
start.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .. import atomic
from ..config import save_config, to_dict
from ..distributed.materialize import build_model
from ..distributed.mesh import build_meshes, init_distributed
from . import import_hf
from .import_hf import check_out, describe_balancing, read_config, run_config, shard_files, write_run


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(nproc: int, argv: list[str]) -> int:
    """Re-run `dropless import-hf` with `argv` (without --nproc) under torchrun on `nproc` processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dropless.hf.import_cli", *argv]
    print(f"launching: {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, env=os.environ.copy()).returncode


def write_run_sharded(hf_dir: str | Path, out: str | Path, overrides: list[str], progress: bool = False):
    """This rank's part of the import (module note); collective. Returns the run config."""
    from ..data.tokenizer import HFTokenizer
    from ..runs import checkpoint as ckpt
    from ..runs import dist_checkpoint

    hf_dir, out = Path(hf_dir), Path(out).absolute()
    init_distributed(torch.device("cpu"))
    rank = dist.get_rank()
    model_cfg, family = import_hf.checkpoint_config(hf_dir)
    cfg = import_hf.run_config(model_cfg, out / "tokenizer" / "tokenizer.json", overrides)
    tmp = out.with_name(f".{out.name}.import-world")  # hidden, and the same name on every rank
    failed = torch.zeros(1)
    if rank == 0:
        try:
            import_hf.check_out(hf_dir, out, overrides)
            shutil.rmtree(tmp, ignore_errors=True)
            import_hf.copy_tokenizer(hf_dir, tmp / "tokenizer")
            vocab = HFTokenizer(tmp / "tokenizer").vocab_size
            if vocab > cfg.model.vocab_size:
                raise ValueError(f"tokenizer.json: {vocab} tokens, more than config.json vocab_size="
                                 f"{cfg.model.vocab_size}")
        except Exception:
            failed += 1
            shutil.rmtree(tmp, ignore_errors=True)
            dist.all_reduce(failed)
            raise
    dist.all_reduce(failed)
    if failed.item():
        raise ValueError("rank 0 refused the import (its error is above)")
    try:
        meshes = build_meshes(cfg.parallel.ep_size, "cpu", cfg.parallel.hier_node_size)
        loader = import_hf.WeightLoader(hf_dir, progress and rank == 0)
        model, names, _ = build_model(cfg.model, torch.device("cpu"), 0, meshes, cfg.parallel, loader)
        state = {"step": 0, "rng": ckpt.rng_state(), "config": to_dict(cfg), "world_size": dist.get_world_size(),
                 "imported_from": str(hf_dir.absolute()), "optimizer_state": False, "family": family}
        dist_checkpoint.save(tmp, 0, model, None, state, experts=names, meshes=meshes)
        if rank == 0:
            save_config(cfg, tmp / "config.toml")
            atomic.publish_dir(tmp, out, fsync=True)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless import-hf",
                                description="Import a Hugging Face Qwen3-MoE, Mixtral or DeepSeek-V3 checkpoint as a run.")
    p.add_argument("hf_dir", metavar="DIR", help="folder with config.json, *.safetensors, tokenizer.json")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="the run directory to write")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value",
                   help="override a field of the run's config (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--nproc", type=int, default=0,
                   help="processes (torchrun): each holds and reads only its shards (hf/py)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    try:
        if args.nproc < 0:
            raise ValueError(f"--nproc {args.nproc}: must be >= 1")
        if under_torchrun():
            write_run_sharded(args.hf_dir, args.out, args.overrides, not args.no_progress)
            return 0  # the launching process reports
        elif args.nproc > 1:
            hf_dir, out = Path(args.hf_dir), Path(args.out).absolute()
            check_out(hf_dir, out, args.overrides)  # refused here, before N processes start
            cfg = run_config(import_hf.checkpoint_config(hf_dir)[0], out / "tokenizer" / "tokenizer.json",
                             args.overrides)
            if args.nproc % cfg.parallel.ep_size:
                raise ValueError(f"parallel.ep_size={cfg.parallel.ep_size} does not divide --nproc {args.nproc}")
            shard_files(hf_dir)
            rest = [a for i, a in enumerate(argv) if not (a == "--nproc" or a.startswith("--nproc=") or
                                                         (i > 0 and argv[i - 1] == "--nproc"))]
            code = launch(args.nproc, rest)
            if code:
                return code
        else:
            cfg = write_run(args.hf_dir, args.out, args.overrides, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless import-hf: error: {err}", file=sys.stderr)
        return 2
    hf = read_config(args.hf_dir)
    print(f"imported {hf['model_type']} from {args.hf_dir} into {args.out}")
    print(describe_balancing(cfg.model, hf))
    return 0


if __name__ == "__main__":
    sys.exit(main())
