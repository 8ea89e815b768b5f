"""Train the default preset on CUDA and watch the MoE layers for host syncs (run by gpu_check.sh).

    python scripts/gpu_train_check.py OUT_DIR [--steps 100]

`torch.cuda.set_sync_debug_mode("warn")` is switched on only while an MoE layer runs: from the
layer's forward pre-hook to its forward hook, and in backward from the moment the gradient of its
output arrives (a hook on `out.y`) to the moment the gradient of its input is complete (a hook on the
input). Syncs elsewhere (the trainer's log steps read the host by design) are not counted. The
detector is tested first: a deliberate `.item()` inside the window must be caught.

Checks: the run picked cuda and bf16; the loss fell (last logged loss < first - 0.7); no sync warning
from inside a layer. If deterministic algorithms refuse an op on CUDA, the error is recorded and the
run is repeated with train.deterministic=false. Writes OUT_DIR/train_check.json; exits 1 if a
check failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from dropless.config import load_config
from dropless.layers.moe import MoELayer
from dropless.train.loop import Trainer
from dropless.train.run import preset_path

SYNC_TEXT = "synchroniz"  # "called a synchronizing CUDA operation"


def _set_mode(mode: str):
    def hook(*_):
        torch.cuda.set_sync_debug_mode(mode)
        return None

    return hook


def watch_layers(model: torch.nn.Module) -> int:
    """Sync-debug 'warn' inside every MoE layer's forward and backward; returns the layer count."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        def pre(mod, args):
            torch.cuda.set_sync_debug_mode("warn")
            if torch.is_grad_enabled() and args[0].requires_grad:
                args[0].register_hook(_set_mode("default"))  # the layer's backward is complete

        def post(mod, args, out):
            torch.cuda.set_sync_debug_mode("default")
            if out.y.requires_grad:
                out.y.register_hook(_set_mode("warn"))  # the layer's backward starts

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)
    return len(layers)


def detector_works() -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            torch.ones(1, device="cuda").sum().item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return any(SYNC_TEXT in str(w.message) for w in caught)


def train(out: Path, steps: int, deterministic: bool) -> dict:
    overrides = [f"train.steps={steps}", f"train.eval_every={steps}", f"train.ckpt_every={steps}",
                 "train.device=cuda", f"train.deterministic={str(deterministic).lower()}",
                 "log.plots=false", "log.tensorboard=false", "log.progress=false"]
    cfg = load_config(preset_path("tiny"), overrides)
    run_dir = out / f"run-{'det' if deterministic else 'nondet'}"
    trainer = Trainer(cfg, run_dir)
    n_layers = watch_layers(trainer.model)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = trainer.fit()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if SYNC_TEXT in str(w.message)]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]  # the first interval includes warm-up
    return {
        "deterministic": deterministic, "moe_layers_watched": n_layers, "wall_s": wall,
        "placement": trainer.layout.placement.as_dict(), "first_loss": losses[0], "last_loss": losses[-1],
        "final_val_loss": summary["final_val_loss"], "tokens_per_s_median": statistics.median(tps) if tps else None,
        "step_ms_median": statistics.median(r["step_ms"] for r in rows if "step_ms" in r),
        "sync_warnings_inside_layers": syncs[:20], "n_sync_warnings_inside_layers": len(syncs),
        "other_warnings": sorted({str(w.message)[:200] for w in caught if SYNC_TEXT not in str(w.message)})[:20],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "detector_works": detector_works(), "runs": []}
    for deterministic in (True, False):
        try:
            report["runs"].append(train(args.out, args.steps, deterministic))
            break
        except Exception as err:  # recorded, then the non-deterministic run is tried
            report["runs"].append({"deterministic": deterministic, "error": repr(err),
                                   "traceback": traceback.format_exc()[-3000:]})
    last = report["runs"][-1]
    checks = {
        "detector_works": report["detector_works"],
        "trained": "error" not in last,
        "deterministic_default_ran": "error" not in report["runs"][0],
        "picked_cuda_bf16": "error" not in last and last["placement"]["device"].startswith("cuda")
                            and last["placement"]["dtype"] == "bf16",
        "loss_fell": "error" not in last and last["last_loss"] < last["first_loss"] - 0.7,
        "no_sync_inside_layers": "error" not in last and last["n_sync_warnings_inside_layers"] == 0,
    }
    report["checks"] = checks
    (args.out / "train_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    for run in report["runs"]:
        print(json.dumps({k: v for k, v in run.items() if k != "traceback"}, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
