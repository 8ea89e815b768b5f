"""`dropless train`: build the config (preset + overrides), pick the run directory, train.

    dropless train [--config NAME|FILE] [--set a.b=value ...] [--run-dir DIR] [--resume] [--nproc N]
                   [--replay-routing RECORD] [--init-from hf:DIR]
                   [--nnodes M --node-rank I --master-addr HOST [--master-port PORT]]

With `train.lora.rank` set, `--init-from hf:DIR` becomes `train.lora.base_from` (the frozen base the
adapters train on, reloaded at every start and checked by its digest: runs/lora_base.py).

`--init-from hf:DIR` fine-tunes a Hugging Face Qwen3-MoE, Mixtral or DeepSeek-V3 checkpoint (hf/, docs/models.md): the
run takes the checkpoint's model (config.json, through hf/mapping.py, including its balancing rule)
and tokenizer (DIR/tokenizer.json), the preset's train/data/log sections, then the `--set`
overrides; the weights are loaded into the fresh model before anything else touches it. The run log
says which balancing rule is active.

`--replay-routing RECORD` trains on a routing record's sequences with its expert ids (routing replay,
data/replay.py); it is `--set data.replay_routing=RECORD`, so config.toml keeps it for --resume.

Several processes: `--nproc N` re-launches the same command under torchrun
(`python -m torch.distributed.run --standalone --nproc-per-node N -m dropless.train ...`), with the run
directory chosen once, here; `torchrun ... -m dropless.train ...` directly works as well (rank 0 picks
the directory and tells the others). torchrun's agent watches the workers: when one dies, it stops the
others and exits non-zero with the failing rank's error, and `--resume` continues from the last
complete checkpoint (a save interrupted by the failure is never published).

Several machines: the same command on each of M machines, with `--nnodes M --node-rank I --nproc P
--master-addr HOST --run-dir DIR` (HOST: node 0's address; DIR: the same path on every node, on
storage they share). Underneath, torchrun's elastic c10d rendezvous at HOST:PORT, hosted by node 0
(`_rendezvous`); every node's launcher checks the config before starting its P processes.

`--config` takes a preset name (`tiny`, `dense`, ... from dropless/presets/) or a TOML file. Without
`--run-dir` a new folder `runs/<preset>-<time>` is made; `--resume` without `--run-dir` continues the
newest `runs/<preset>-*` that has a complete checkpoint.

Resume (`--resume`) continues with the run's own `config.toml` (what it was started, or last resumed,
with), and `--set` overrides apply on top of it. Changes that would make the checkpoint's weights
another model (its shape, architecture or routing) are refused; every other change is printed and
logged in metrics.jsonl (resume.py has the rules). `--config` is not applied on resume: it only names
the preset whose newest run to continue when `--run-dir` is not given, and a note on stderr lists
the fields where it differs from the run's config (ignoring it beats a silent mix of two configs, and
refusing it would block the one-word `--config dense --resume`; a field to change goes in --set).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..config import RunConfig, apply_overrides, from_dict, load_config, to_dict
from ..distributed.mesh import check_layout, init_distributed, under_torchrun
from ..runs.presets import DEFAULT_PRESET, preset_path
from ..runs import checkpoint as ckpt
from ..runs import resume


if TYPE_CHECKING:
    from .loop import Trainer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dropless train", description="Train an MoE language model.")
    p.add_argument("--config", default=None,
                   help="preset name or TOML file (default: tiny); with --resume only the preset whose "
                        "newest run to continue when --run-dir is not given: the run's own config.toml "
                        "is used")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value",
                   help="override a config field by dotted name (repeatable)")
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/<preset>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint")
    p.add_argument("--replay-routing", default=None, metavar="RECORD",
                   help="train on this routing record's sequences, replaying its expert ids "
                        "(= --set data.replay_routing=RECORD)")
    p.add_argument("--init-from", default=None, metavar="hf:DIR",
                   help="start from a Hugging Face checkpoint (its model, weights and tokenizer; "
                        "the preset's train/data/log sections; then --set)")
    p.add_argument("--nproc", type=int, default=0,
                   help="processes to launch with torchrun (default: one process, no launcher); per "
                        "node with --nnodes")
    p.add_argument("--nnodes", type=int, default=1,
                   help="machines in the run: run the same command on each, with its --node-rank")
    p.add_argument("--node-rank", type=int, default=None, help="this machine's index, 0 .. nnodes-1 "
                   "(node 0 hosts the rendezvous)")
    p.add_argument("--master-addr", default=None, help="address of node 0, reachable from every node")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port on node 0 (default 29500)")
    return p


NODE_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port")


def check_nodes(args: argparse.Namespace) -> None:
    """The launcher's flags, before anything starts (ValueError naming the flag and value)."""
    if args.nproc < 0:
        raise ValueError(f"--nproc {args.nproc}: must be >= 1")
    if args.nnodes < 1:
        raise ValueError(f"--nnodes {args.nnodes}: must be >= 1")
    if args.nnodes == 1:
        for flag, value in (("--node-rank", args.node_rank), ("--master-addr", args.master_addr),
                            ("--master-port", args.master_port)):
            if value is not None:
                raise ValueError(f"{flag} {value}: only with --nnodes > 1 (one machine needs no rendezvous)")
        return
    if args.nproc < 1:
        raise ValueError(f"--nnodes {args.nnodes} needs --nproc P, the processes on each node")
    if args.node_rank is None or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank}: give this node's index, 0 .. {args.nnodes - 1}")
    if not args.master_addr:
        raise ValueError(f"--nnodes {args.nnodes} needs --master-addr, the address of node 0")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ValueError(f"--master-port {args.master_port}: must be 1 .. 65535")
    if args.run_dir is None:
        raise ValueError(f"--nnodes {args.nnodes} needs --run-dir: the same path on every node, on storage "
                         "they all share (checkpoints are written by every rank)")


def launch(args: argparse.Namespace, argv: list[str], run_dir: Path) -> int:
    """Re-run this command under torchrun with N processes; returns torchrun's exit status."""
    # Drop --nproc (and its value) and any --run-dir: the chosen one is passed. On resume drop --config
    # too: the run's own config is used, and its note was printed here already.
    dropped = ("--nproc", "--run-dir", *NODE_FLAGS) + (("--config",) if args.resume else ())
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in dropped:
            skip = True
        elif not a.startswith(tuple(d + "=" for d in dropped)):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", *_rendezvous(args, run_dir),
           f"--nproc-per-node={args.nproc}", "-m", "dropless.train", *rest, "--run-dir", str(run_dir)]
    print(f"launching: {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, env=os.environ.copy()).returncode


def _rendezvous(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """torchrun's rendezvous flags. One node: `--standalone` (a local store on a free port). Several:
    torchrun's elastic c10d rendezvous at master-addr:port, which node 0 hosts (`is_host`, so that
    two "nodes" on one machine do not both try to). The job id is the run directory's, the same on
    every node. torchrun numbers ranks node by node, which keeps each ep group in one node
    (distributed/mesh.py checks it)."""
    if args.nnodes == 1:
        return ["--standalone"]
    job = "dropless-" + hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.master_addr}:{args.master_port or 29500}", f"--rdzv-id={job}",
            f"--rdzv-conf=is_host={int(args.node_rank == 0)}"]


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


def resolve_config(args: argparse.Namespace, path: Path, run_dir: Path, quiet: bool = False) -> RunConfig:
    """A new run: the preset (or file) with the overrides. A resume: the run's own config.toml with the
    overrides on top, checked against the checkpoint's config (resume.py: the model's shape and
    routing cannot change); `--config` is then ignored, with a note when it differs."""
    if not args.resume:
        if ckpt.latest_checkpoint(run_dir) is not None:
            raise ValueError(f"--run-dir {run_dir} already holds checkpoints: pass --resume, or choose another")
        source = init_source(args)
        if source is not None:
            from ..hf import import_hf

            cfg = import_hf.init_config(source, load_config(path), args.overrides)
            if cfg.train.lora.enabled and not cfg.train.lora.base_from:  # the run names its base (lora_base.py)
                cfg = apply_overrides(cfg, [f"train.lora.base_from=hf:{source.resolve()}"])
            return cfg
        return load_config(path, args.overrides)
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {run_dir / ckpt.CHECKPOINT_DIR}")
    from ..runs.dist_checkpoint import trainer_state

    saved = trainer_state(latest)
    cfg = resume.run_config(run_dir, saved["config"], args.overrides)
    if args.config is not None:
        note = resume.config_file_note(load_config(path), resume.run_config(run_dir, saved["config"], []),
                                       args.config)
        if note and not quiet:
            print(note, file=sys.stderr, flush=True)
    resume.check_resume_config(saved["config"], cfg, int(saved["step"]))  # before any process starts
    return cfg


def init_source(args: argparse.Namespace) -> Path | None:
    """The Hugging Face folder of `--init-from hf:DIR`, or None."""
    if args.init_from is None:
        return None
    if not args.init_from.startswith("hf:") or len(args.init_from) == 3:
        raise ValueError(f"--init-from {args.init_from!r}: expected hf:DIR (a Hugging Face checkpoint folder)")
    if args.resume:
        raise ValueError(f"--init-from {args.init_from} with --resume: a resumed run continues from its own "
                         "checkpoint")
    return Path(args.init_from[3:])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.replay_routing is not None:
        args.overrides.append(f"data.replay_routing={Path(args.replay_routing).resolve()}")
    try:
        check_nodes(args)
        path = preset_path(args.config or DEFAULT_PRESET)
        if args.nproc and not under_torchrun():
            run_dir = choose_run_dir(args, path.stem)
            cfg = resolve_config(args, path, run_dir)  # a bad config fails here, before N processes start
            world = args.nproc * args.nnodes
            if cfg.train.compile == "step" and world > 1 and cfg.parallel.fsdp:  # (the Trainer refuses it too)
                raise ValueError(f"train.compile='step' with --nproc {args.nproc} and parallel.fsdp=true: FSDP2's "
                                 "hooks cannot be traced; set parallel.fsdp=false, or use train.compile=blocks")
            p = cfg.parallel  # a two-level dispatch spans nodes by design (distributed/ep_hier.py)
            check_layout(p.pp_size, p.ep_size, world, world if p.ep_hierarchy == "node" else args.nproc)
            return launch(args, argv, run_dir)
        from ..device import resolve_device

        distributed = init_distributed(resolve_device(_device_setting(args, path))[0])
        if distributed:  # rank 0 decides (directory, config) and tells the others, errors included
            run_dir, cfg = _agree(lambda: _prepare(args, path))
        else:
            run_dir, cfg = _prepare(args, path)
        from .loop import Trainer

        source = init_source(args)
        init_weights = None
        if source is not None:
            from ..hf import import_hf

            if not cfg.train.lora.enabled:  # (a LoRA run loads its base itself)
                init_weights = import_hf.weight_loader(source, progress=cfg.log.progress)
        trainer = Trainer(cfg, run_dir, resume=args.resume, init_weights=init_weights)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless train: error: {err}", file=sys.stderr)
        return 2
    if trainer.layout.is_main:
        print(f"run directory: {run_dir}")
        if source is not None:
            rule = import_hf.describe_balancing(cfg.model, import_hf.read_config(source))
            print(f"initialised from {source}; {rule}")
            trainer.run_dir.write({"step": 0, "init_from": str(source), "balancing": rule})
    if trainer.start_step >= cfg.train.steps:  # a finished run: keep its summary, say how to extend it
        if trainer.layout.is_main:
            print(f"nothing to train: the run is complete at step {trainer.start_step} "
                  f"(--set train.steps=N with N > {trainer.start_step} trains longer)")
        _finish(trainer)
        return 0
    summary = trainer.fit()
    if trainer.layout.is_main:
        print(json.dumps(summary, indent=2))
    _finish(trainer)
    return 0


def _finish(trainer: "Trainer") -> None:
    if trainer.layout.distributed:
        import torch.distributed as dist

        dist.destroy_process_group()


def _device_setting(args: argparse.Namespace, path: Path) -> str:
    """`train.device` as this process sees it before the process group exists (the backend, gloo or
    NCCL, follows the device). A bad config is reported later, by rank 0 to every rank (`_agree`)."""
    try:
        return _prepare(args, path, quiet=True)[1].train.device
    except (ValueError, FileNotFoundError):
        return "auto"


def _prepare(args: argparse.Namespace, path: Path, quiet: bool = False) -> tuple[Path, RunConfig]:
    run_dir = choose_run_dir(args, path.stem)
    return run_dir, resolve_config(args, path, run_dir, quiet)


def _agree(prepare: Callable[[], tuple[Path, RunConfig]]) -> tuple[Path, RunConfig]:
    """Run `prepare` on rank 0 and broadcast its result (or its error, raised on every rank)."""
    import torch.distributed as dist

    box: list = [None]
    if dist.get_rank() == 0:
        try:
            run_dir, cfg = prepare()
            box = [("ok", str(run_dir), to_dict(cfg))]
        except (ValueError, FileNotFoundError) as err:
            box = [(type(err).__name__, str(err), None)]
    dist.broadcast_object_list(box, src=0)
    kind, value, cfg_dict = box[0]
    if kind == "FileNotFoundError":
        raise FileNotFoundError(value)
    if kind != "ok":
        raise ValueError(value)
    return Path(value), from_dict(RunConfig, cfg_dict)


if __name__ == "__main__":
    sys.exit(main())
