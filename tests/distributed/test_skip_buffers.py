"""A skipped step changes nothing under several processes: parameter shards, optimizer state
and the router buffers (loss-free bias, quantile-balancing bias) stay bit-identical on every rank.

- Buffered EP without retry: an overflowing step is skipped. The optimizer skipped it before, but the
  bias rules still moved the bias from the skipped step's counts.
- Non-finite: NaN on rank 0 only (its loss and, through the gradient all-reduce, every gradient); both
  ranks must skip the same step, or their replicas of the router buffers part ways.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dist_harness import run_world
from dropless.train.loop import Trainer
from tiny_run import tiny

BUFFERED = ("model.moe.router.use_expert_bias=true", "parallel.ep_size=2", "parallel.ep_mode=buffered",
            "parallel.ragged_buffer_factor=0.5", "parallel.retry_on_overflow=false", "train.steps=4",
            "train.dtype=fp32")
RULES = {"bias": ("model.moe.balance.bias_update_rate=0.01",),
         "quantile": ("model.moe.balance.quantile_balance=true",)}


def _state(trainer: Trainer) -> list[torch.Tensor]:
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    out = [local(b).clone() for b in trainer.model.buffers()]
    for p in trainer.model.parameters():
        out.append(local(p).clone())
        out += [local(v).clone() for v in trainer.optimizer.state[p].values()]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _cases(rank: int, world: int, root: Path) -> None:
    for name, rule in RULES.items():
        trainer = Trainer(tiny(*BUFFERED, *rule), root / name)
        for layer in trainer.model.moe_layers():  # every token to experts 0 and 1 (rank 0's): overflow
            layer.router.set_bias(torch.tensor([1.0, 1.0, 0.0, 0.0]))
        before = _state(trainer)
        trainer.train_step(0)
        assert _same(before, _state(trainer)), name
        assert trainer.overflow.skipped.item() == 1

    trainer = Trainer(tiny("model.moe.router.use_expert_bias=true", *RULES["bias"], "train.dtype=fp32",
                           "train.steps=4"), root / "nan")
    poison = {"on": False}
    trainer.model.norm.register_forward_hook(
        lambda mod, args, out: out * float("nan") if poison["on"] and rank == 0 else out)
    trainer.train_step(0)
    before = _state(trainer)
    poison["on"] = True
    sums, _ = trainer.train_step(1)
    poison["on"] = False
    assert torch.isfinite(sums.loss).item() == (rank != 0)  # only rank 0's own loss is NaN
    assert _same(before, _state(trainer))
    trainer.train_step(2)
    assert not _same(before, _state(trainer))  # a good step moves everything again
    trainer.nonfinite.read()
    assert trainer.nonfinite.take() == 1


def test_skipped_step_changes_nothing_on_any_rank(tmp_path: Path) -> None:
    run_world(_cases, 2, tmp_path, tmp_path)
