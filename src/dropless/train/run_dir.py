"""The run directory as the trainer writes it: the JSONL logs, checkpoints and their resume, the
config, the progress and TensorBoard sinks of a fit, the summary and the plots.

    config.toml      the resolved config of the latest start or resume
    metrics.jsonl    log rows, validation losses, placement, resume and EP rows
    routing.jsonl    the routing record of every log step (health.py)
    health.jsonl     the alarms that fired (monitor/alarms.py)
    checkpoints/     torch.distributed.checkpoint folders, written and resumable at any world size
    tensorboard/     with log.tensorboard
    summary.json     the fit's summary; plots with log.plots (plots.py)

Only rank 0 writes files and progress; every rank takes part in a checkpoint. Resume is exact: a
checkpoint holds model, optimizer, step, RNG state and the routing monitor's running sums; batches and
learning rates are functions of the step; the logs are cut back to the checkpoint's step before the
run goes on. What a resumed run may change in its config: runs/resume.py.

`open_run_dir` is the trainer's first write, after everything a bad config or data path can fail on:
a failed start leaves no run directory behind and writes nothing into an existing one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..data.replay import ReplayData
from ..model import MoEModel
from ..runs import checkpoint as ckpt
from ..runs import dist_checkpoint
from ..runs.resume import check_resume_config, optimizer_note, report_resume
from ..runs.sinks import JsonlLog, Progress, TensorBoard
from .layout import Layout
from .nonfinite import NonFiniteGuard


@dataclass
class Sinks:
    """A fit's reporting besides metrics.jsonl: TensorBoard, the progress bar, rank 0's console
    lines, and the throughput since the last log row."""

    tb: TensorBoard
    bar: Progress
    is_main: bool
    tokens_per_step: float
    last_step: int
    last_time: float = field(default_factory=time.perf_counter)

    def say(self, text: str) -> None:
        if self.is_main:
            self.bar.write(text)

    def throughput(self, step: int) -> tuple[float, float]:
        """(tokens/s, ms per step) since the last call, which ended at `step`."""
        now = time.perf_counter()
        n_steps = step + 1 - self.last_step
        tps = self.tokens_per_step * n_steps / max(now - self.last_time, 1e-9)
        step_ms = 1e3 * (now - self.last_time) / n_steps
        self.last_time, self.last_step = now, step + 1
        return tps, step_ms

    def show(self, step: int, row: dict[str, Any]) -> None:
        """A log row on TensorBoard and beside the progress bar."""
        self.tb.scalars(step, row)
        fields = {"loss": f"{row['loss']:.3f}", "tok/s": f"{row['tokens_per_s']:,.0f}"}
        if "maxvio_global" in row:
            fields["maxvio"] = f"{row['maxvio_global']:.2f}"
        self.bar.update(step + 1, fields)

    def close(self) -> None:
        self.bar.close()
        self.tb.close()


@dataclass
class RunDir:
    path: Path
    is_main: bool
    metrics: JsonlLog
    routing: JsonlLog
    health_log: JsonlLog

    def write(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl row (rank 0's)."""
        if self.is_main:
            self.metrics.write(row)

    def resume(self, cfg: RunConfig, layout: Layout, model: MoEModel, optimizer: torch.optim.Optimizer,
               nonfinite: NonFiniteGuard, replay: ReplayData | None) -> dict[str, Any]:
        """Load the latest checkpoint (written at any world size) into the model, the optimizer, the
        RNG, the non-finite counters and the replay's position, after checking that `cfg` may
        continue it (resume.py); cut the logs back to its step and log the config changes and the
        world size. Returns the checkpoint's state (its "step", the health monitor's "health")."""
        path = ckpt.latest_checkpoint(self.path)
        if path is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {self.path / 'checkpoints'}")
        saved = dist_checkpoint.trainer_state(path)
        changes = check_resume_config(saved["config"], cfg, int(saved["step"]))
        fresh = optimizer_note(changes)  # another optimizer's state is not loaded (resume.py)
        # an imported model's step-0 checkpoint holds no optimizer state (hf/import_hf.py)
        with_state = fresh is None and saved.get("optimizer_state", True)
        state = dist_checkpoint.load(path, model, optimizer, experts=layout.expert_names,
                                     meshes=layout.meshes, optimizer_state=with_state)
        ckpt.set_rng_state(state["rng"])
        nonfinite.load_state_dict(state.get("nonfinite", {}))
        step = int(state["step"])
        note = replay.resume(state.get("replay"), step) if replay is not None else None
        if note and self.is_main:
            print(note, flush=True)
        if self.is_main:
            for log in (self.metrics, self.routing, self.health_log):
                log.truncate_from(step)
            report_resume(path, state, layout.world_size, changes, self.metrics, [fresh] if fresh else [])
        if layout.distributed:
            dist.barrier()  # the logs are cut before any rank reads them
        return state

    def open_sinks(self, cfg: RunConfig, start_step: int, tokens_per_step: float) -> Sinks:
        return Sinks(TensorBoard(self.path / "tensorboard", cfg.log.tensorboard and self.is_main),
                     Progress(cfg.train.steps, start_step, cfg.log.progress and self.is_main),
                     self.is_main, tokens_per_step, start_step)

    def finish(self, cfg: RunConfig, layout: Layout, val_loss: float, wall_s: float) -> dict[str, Any]:
        """The fit's summary (rank 0 writes summary.json, and the plots with log.plots)."""
        if not self.is_main:
            return {"steps": cfg.train.steps, "final_val_loss": val_loss, "rank": layout.rank}
        train_rows = [r for r in self.metrics.read() if "loss" in r]
        params = layout.param_counts
        summary = {
            "steps": cfg.train.steps,
            "final_val_loss": val_loss,
            "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
            "tokens_per_s": (sum(r["tokens_per_s"] for r in train_rows[-10:]) / len(train_rows[-10:])
                             if train_rows else None),
            "params_total": params["total"],
            "params_active": params["active"],
            "nonfinite_steps": sum(r.get("nonfinite_steps", 0) for r in train_rows),  # resumes included
            **layout.placement.as_dict(),
            "wall_s_this_process": wall_s,
        }
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if cfg.log.plots:
            from .plots import write_run_plots

            summary["plots"] = [str(p) for p in write_run_plots(self.path)]
        return summary


def open_run_dir(path: str | Path, resume: bool, is_main: bool) -> RunDir:
    """The run directory, created if new; a fresh run's logs emptied (a resume cuts them later, at
    its checkpoint's step)."""
    path = Path(path)
    if resume and ckpt.latest_checkpoint(path) is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {path / 'checkpoints'}")
    path.mkdir(parents=True, exist_ok=True)
    run = RunDir(path, is_main, JsonlLog(path / "metrics.jsonl"), JsonlLog(path / "routing.jsonl"),
                 JsonlLog(path / "health.jsonl"))
    if not resume and is_main:
        for log in (run.metrics, run.routing, run.health_log):
            log.truncate_from(0)
    return run
