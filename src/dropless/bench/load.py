"""`dropless bench load`: time and memory of loading a Hugging Face checkpoint into a placed model.

    dropless bench load DIR [--nproc N] [--set parallel.ep_size=E ...] [--dtype fp32|bf16] [--json FILE]

Each of N spawned processes (gloo process group when N > 1, none at N = 1, as `dropless train`
without --nproc) does what `dropless train --init-from hf:DIR` does up to its first step:
`import_hf.init_config` (the preset `tiny` with the checkpoint's model, then the --set overrides),
`build_layout`, and `place_model` with `import_hf.weight_loader(DIR)` (build, fill, parallelise:
EP, then FSDP2). Per rank it reports:
- seconds: wall time of place_model (build + read + parallelise);
- bytes read: the loader's `bytes_read` (bytes this rank read from the safetensors files), "n/a"
  where the loader does not count them;
- baseline: VmRSS just before place_model: after the imports, the process group and build_layout
  (whose deterministic mode alone costs torch 26 MiB of its own setup, not the load's);
- peak: VmHWM after place_model, its high-water mark reset to the baseline first (writing 5 to
  /proc/self/clear_refs), so that it is the peak of the load alone and not of the process's life
  (ru_maxrss, the lifetime peak, cannot be reset); where the reset is refused, the lifetime peak,
  and the JSON says so;
- final model bytes: what stays resident, the nbytes of the rank's local parameter and buffer
  storages (a DTensor's local shard), each storage counted once;
- ratio: (peak - baseline) / final model bytes.
The checks (a load must not need much more memory than what it keeps):
- world 1: peak - baseline <= 1.15 x final model bytes;
- world N: peak - baseline <= 1.2 x model bytes / N + the largest single tensor of the checkpoint
  (its bytes as stored, from the safetensors headers), where model bytes is the whole unsharded
  model's parameter and buffer bytes (built on the meta device).
Host memory only: the bench runs on the CPU (train.device=cpu). Mapped pages of the safetensors
files count in VmRSS while they are mapped, as they do for the trainer. Measured figures and limits:
docs/loading.md "Measured".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import atomic
from ..config import RunConfig, load_config
from ..distributed.worker_exit import end_worker
from ..cpu_alloc import keep_freed_memory
from ..runs.presets import DEFAULT_PRESET, preset_path
from . import load_memory as mem
from .timing import format_table

COLUMNS = ["rank", "seconds", "bytes_read", "baseline", "peak", "peak_minus_baseline", "final_model_bytes",
           "ratio", "limit", "check"]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dropless bench load", description=__doc__.split("\n")[0])
    p.add_argument("hf_dir", metavar="DIR", help="Hugging Face checkpoint folder (config.json, *.safetensors, "
                                                 "tokenizer.json)")
    p.add_argument("--nproc", type=int, default=1, help="world size (spawned gloo processes)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value",
                   help="override a field of the run's config, as dropless train --set (repeatable)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="train.dtype")
    p.add_argument("--json", default=None, help="write the configuration, the rows and the checks here")
    return p.parse_args(argv)


def run_overrides(args: argparse.Namespace) -> list[str]:
    return ["train.device=cpu", f"train.dtype={args.dtype}", *args.overrides]


def check(args: argparse.Namespace) -> RunConfig:
    """The run config of rank 0, and every refusal that can be made before a process starts."""
    from ..hf import import_hf

    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: must be >= 1")
    if not Path(args.hf_dir).is_dir():
        raise ValueError(f"DIR {args.hf_dir!r}: no such folder")
    mem.require_proc()
    cfg = import_hf.init_config(args.hf_dir, load_config(preset_path(DEFAULT_PRESET)), run_overrides(args))
    if cfg.train.device != "cpu":
        raise ValueError(f"train.device={cfg.train.device!r}: bench load measures host memory; it runs on cpu")
    ep = cfg.parallel.ep_size
    if args.nproc % ep:
        raise ValueError(f"parallel.ep_size={ep}: must divide --nproc {args.nproc}")
    return cfg


def measure_rank(hf_dir: str, overrides: list[str]) -> dict[str, Any]:
    """This process's figures (module note); the process group, if any, is already up, and
    `_import_all` has run (its imports are not the load's memory)."""
    from ..hf import import_hf
    from ..train.layout import build_layout, place_model

    cfg = import_hf.init_config(hf_dir, load_config(preset_path(DEFAULT_PRESET)), overrides)
    layout = build_layout(cfg)
    loader = import_hf.weight_loader(hf_dir)
    baseline = mem.vm_bytes("VmRSS")
    reset = mem.reset_peak()
    start = time.perf_counter()
    layout, model = place_model(cfg, layout, loader)
    seconds = time.perf_counter() - start
    peak = mem.vm_bytes("VmHWM")
    final = mem.resident_bytes([*model.parameters(), *model.buffers()])
    bytes_read = getattr(loader, "bytes_read", None)
    return {"rank": layout.rank, "seconds": seconds, "bytes_read": bytes_read, "baseline": baseline,
            "peak": peak, "peak_minus_baseline": peak - baseline, "final_model_bytes": final,
            "ratio": (peak - baseline) / final if final else float("inf"),
            "peak_source": "VmHWM, reset at the baseline" if reset else "VmHWM, the process's lifetime peak"}


def _import_all() -> None:
    """What the load imports on its way (modules, safetensors), before the baseline is read."""
    import safetensors.torch  # noqa: F401

    from ..distributed import parallelize  # noqa: F401
    from ..hf import import_hf  # noqa: F401
    from ..train import layout  # noqa: F401


def _worker(rank: int, world: int, hf_dir: str, overrides: list[str], store: str, outdir: str) -> None:
    keep_freed_memory()  # as the CLI does before training (cpu_alloc.py); spawned ranks start bare
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    _import_all()
    try:
        row = measure_rank(hf_dir, overrides)
        print(f"rank {rank}: placed in {row['seconds']:.1f} s, peak - baseline "
              f"{mem.gib(row['peak_minus_baseline'])}, final model {mem.gib(row['final_model_bytes'])}",
              file=sys.stderr, flush=True)
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(row))
    except BaseException:
        if world > 1:
            dist.destroy_process_group()
        raise
    end_worker()  # worker_exit.py: the trainer's meshes outlive destroy_process_group()


def run(hf_dir: str, world: int, overrides: list[str]) -> list[dict[str, Any]]:
    """The per-rank rows, from `world` spawned processes."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, str(hf_dir), overrides, os.path.join(tmp, "store"), tmp),
                           nprocs=world, start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def judge(rows: list[dict[str, Any]], world: int, model_bytes: int, largest: int) -> None:
    """Add each rank's limit and PASS/FAIL (module note) to its row."""
    for r in rows:
        limit = 1.15 * r["final_model_bytes"] if world == 1 else 1.2 * model_bytes / world + largest
        r["limit"] = int(limit)
        r["check"] = "PASS" if r["peak_minus_baseline"] <= limit else "FAIL"


def table(rows: list[dict[str, Any]]) -> str:
    def show(r: dict[str, Any]) -> dict[str, Any]:
        out = {k: mem.gib(v) if isinstance(v, int) and k not in ("rank",) else v for k, v in r.items()}
        out["bytes_read"] = "n/a" if r["bytes_read"] is None else mem.gib(r["bytes_read"])
        out["seconds"] = f"{r['seconds']:.2f}"
        out["ratio"] = f"{r['ratio']:.2f}"
        return out
    return format_table([show(r) for r in rows], COLUMNS)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = check(args)
        name, largest = mem.largest_tensor(args.hf_dir)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless bench load: error: {err}", file=sys.stderr)
        return 2
    model_bytes = mem.model_bytes(cfg)
    rows = run(args.hf_dir, args.nproc, run_overrides(args))
    judge(rows, args.nproc, model_bytes, largest)
    rule = ("peak - baseline <= 1.15 x final model bytes" if args.nproc == 1 else
            f"peak - baseline <= 1.2 x model bytes / {args.nproc} + largest tensor")
    print(f"dropless bench load {args.hf_dir}: world {args.nproc}, ep {cfg.parallel.ep_size}, dtype {args.dtype}; "
          f"model {mem.gib(model_bytes)} (fp32, unsharded); largest tensor {name} {mem.gib(largest)}")
    print(table(rows))
    print(f"check: {rule}; {sum(r['check'] == 'PASS' for r in rows)}/{len(rows)} ranks pass")
    if args.json:
        result = {"config": {"hf_dir": str(Path(args.hf_dir).absolute()), "nproc": args.nproc,
                             "ep_size": cfg.parallel.ep_size, "dtype": args.dtype, "overrides": args.overrides},
                  "model_bytes": model_bytes, "largest_tensor": {"name": name, "bytes": largest},
                  "rule": rule, "rows": rows}
        with atomic.atomic_write(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0 if all(r["check"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
