"""The tiny training configuration the trainer tests share (one process and spawned gloo worlds alike:
tests/ is on the import path of both, see conftest.py and distributed/dist_harness.py's callers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dropless.config import RunConfig, load_config
from dropless.train.loop import Trainer

# 2 layers of width 32, 4 experts top-2, 20 steps of 4 x 32 tokens on 200 kB of the corpus: seconds.
# On the CPU whatever the machine (tests/test_cuda.py asks for cuda explicitly).
TINY = [
    "train.device=cpu",
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32",
    "model.d_ff_dense=64", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.d_expert=32",
    "train.batch_size=4", "train.seq_len=32", "train.steps=20", "train.warmup_steps=2",
    "train.eval_every=10", "train.eval_batches=2", "train.ckpt_every=10", "train.lr=1e-2",
    "data.max_bytes=200000", "log.log_every=1", "log.progress=false", "log.tensorboard=false",
    "log.plots=false",
]


def tiny(*extra: str) -> RunConfig:
    """TINY with `extra` dotted overrides applied after it (a later setting of a field wins)."""
    return load_config(None, TINY + list(extra))


def rows(run_dir: Path, key: str) -> list[dict]:
    """The metrics.jsonl rows holding `key`, without the timing fields (they differ run to run)."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if key in r:
            out.append({k: v for k, v in r.items() if k not in ("tokens_per_s", "step_ms", "data_ms")})
    return out


def crash_at(trainer: Trainer, crash_step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run `trainer` until it dies at `crash_step` (before that step's update), like a killed job."""
    real_step = trainer.train_step

    def crashing(step: int, *args):
        if step == crash_step:
            raise KeyboardInterrupt("simulated crash")
        return real_step(step, *args)

    monkeypatch.setattr(trainer, "train_step", crashing)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()


def check_crash_resume(tmp_path: Path, extra: tuple[str, ...], crash_step: int, ckpt_step: int,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An uninterrupted run and one killed at `crash_step`, then resumed from its step-`ckpt_step`
    checkpoint, write the same losses and every value of every routing.jsonl row."""
    from dropless.runs import checkpoint as ckpt

    full, broken = tmp_path / "full", tmp_path / "broken"
    Trainer(tiny(*extra), full).fit()
    crash_at(Trainer(tiny(*extra), broken), crash_step, monkeypatch)
    assert ckpt.latest_checkpoint(broken).name == ckpt.checkpoint_name(ckpt_step)
    Trainer(tiny(*extra), broken, resume=True).fit()
    assert rows(full, "loss") == rows(broken, "loss")
    assert (full / "routing.jsonl").read_text() == (broken / "routing.jsonl").read_text()
