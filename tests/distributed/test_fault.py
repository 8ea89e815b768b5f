"""A rank killed mid-run, in the worst place (inside a checkpoint save, its shards written, the save not
yet published): torchrun stops the job with a clear error naming the rank and the signal, the
half-written save is never seen as a checkpoint, and `dropless train --nproc N --resume` continues
from the last complete one to the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dropless.runs import checkpoint as ckpt

HERE = Path(__file__).resolve().parent
ARGS = [
    "--set", "model.d_model=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2",
    "--set", "model.max_seq_len=32", "--set", "model.d_ff_dense=64", "--set", "model.moe.num_experts=4",
    "--set", "model.moe.top_k=2", "--set", "model.moe.d_expert=32", "--set", "train.batch_size=4",
    "--set", "train.seq_len=32", "--set", "train.steps=6", "--set", "train.warmup_steps=2",
    "--set", "train.eval_every=6", "--set", "train.eval_batches=1", "--set", "train.ckpt_every=2",
    "--set", "train.threads=1", "--set", "data.max_bytes=200000", "--set", "log.log_every=1",
    "--set", "log.progress=false", "--set", "log.tensorboard=false", "--set", "log.plots=false",
    "--set", "parallel.ep_size=2", "--set", "train.device=cpu",  # gloo, even on a machine with GPUs
]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    src = str(HERE.parent.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, str(HERE), env.get("PYTHONPATH", "")])
    return env


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow
def test_killed_rank_stops_the_job_and_resume_continues(tmp_path: Path) -> None:
    run = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(HERE / "fault_worker.py"), *ARGS, "--run-dir", str(run)],
        env=_env(DROPLESS_TEST_KILL="1:4"), capture_output=True, text=True, timeout=300)
    assert killed.returncode != 0
    assert "ChildFailedError" in killed.stderr and "SIGKILL" in killed.stderr, killed.stderr[-2000:]
    # the save of step 4 died half-way: its folder exists, hidden and unpublished; step 2 is the latest
    assert (run / "checkpoints" / f".tmp-{ckpt.checkpoint_name(4)}-dcp").is_dir()
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]

    resumed = subprocess.run(
        [sys.executable, "-m", "dropless.cli", "train", "--nproc", "2", "--resume", *ARGS,
         "--run-dir", str(run)], env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ckpt.latest_checkpoint(run).name == ckpt.checkpoint_name(6)

    clean = tmp_path / "clean"
    ok = subprocess.run([sys.executable, "-m", "dropless.cli", "train", "--nproc", "2", *ARGS,
                         "--run-dir", str(clean)], env=_env(), capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert _losses(run) == _losses(clean)  # same steps, same ranks: bit-identical after the resume
