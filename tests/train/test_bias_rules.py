"""The balancing rules as the trainer runs them: each optimizer step moves every MoE layer's expert
bias by the configured rule (checked against layers/balance.py's functions fed the step's global
counts or quantile biases), on the device (no host read in a step), and a resumed run continues
bit for bit (the rules' only state is the bias buffer, which the checkpoint holds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dropless.layers import balance
from dropless.train.loop import Trainer
from host_sync import forbid_host_sync
from tiny_run import check_crash_resume, tiny

RULES = {
    "sign": ("model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0.01"),
    "proportional": ("model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0.05",
                     "model.moe.balance.bias_update_rule=proportional"),
    # the sign rule with a per-expert step that grows and halves (its step and sign are buffers too)
    "adaptive": ("model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0.01",
                 "model.moe.balance.bias_update_rule=adaptive"),
    "quantile_ema": ("model.moe.router.use_expert_bias=true", "model.moe.balance.quantile_balance=true",
                     "model.moe.balance.quantile_momentum=0.75"),
    # the step decays with the lr after its 2 warm-up steps (balance.bias_rate_scale)
    "adaptive_lr": ("model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0.01",
                    "model.moe.balance.bias_update_rule=adaptive", "model.moe.balance.bias_rate_schedule=lr"),
    "sign_lr": ("model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0.01",
                "model.moe.balance.bias_rate_schedule=lr"),
    # two quantile steps, then the sign rule
    "warm_start": ("model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0.01",
                   "model.moe.balance.bias_warm_start_steps=2"),
    # two quantile steps, then the adaptive rule from its initial step (bench balance bias_adaptive_warm)
    "warm_start_adaptive": ("model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0.01",
                            "model.moe.balance.bias_update_rule=adaptive", "model.moe.balance.bias_warm_start_steps=2"),
}


def capture_step(trainer: Trainer) -> dict:
    """Record, at each end_step, the step's global counts and quantile proposals before they are used."""
    seen: dict = {}
    real = trainer.health.end_step

    def end_step(*args, **kwargs) -> None:
        h = trainer.health
        seen["counts_LE"] = h.acc.step_counts_LE.clone()
        seen["quantile"] = [q.clone() for q in h._quantile]
        real(*args, **kwargs)

    trainer.health.end_step = end_step
    return seen


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_step_moves_the_bias_by_the_rule_without_a_host_read(tmp_path: Path, rule: str) -> None:
    trainer = Trainer(tiny(*RULES[rule]), tmp_path)
    seen = capture_step(trainer)
    bal, t = trainer.cfg.model.moe.balance, trainer.cfg.train
    scales = []
    for step in range(5):  # from a nonzero bias: the EMA's and the rules' first term matters
        before = [layer.router.expert_bias.clone() for layer in trainer.health.layers]
        state = [(layer.router.bias_step_E.clone(), layer.router.bias_sign_E.clone())
                 for layer in trainer.health.layers] if bal.bias_update_rule == "adaptive" else None
        with forbid_host_sync("host read in a training step"):
            trainer.train_step(step)
        lr = trainer.optimizer.param_groups[0]["lr"]
        scales.append(balance.bias_rate_scale(bal.bias_rate_schedule, step, lr, t.lr, t.warmup_steps))
        rate = bal.bias_update_rate * scales[-1]
        for i, layer in enumerate(trainer.health.layers):
            quantile = rule == "quantile_ema" or step < bal.bias_warm_start_steps
            assert bool(seen["quantile"]) == quantile  # the layers computed the proposals iff needed
            if quantile:
                q = torch.stack([m[i] for m in seen["quantile"]]).mean(0)  # one rank: the micro mean
                want = balance.quantile_step(before[i], q, bal.quantile_momentum)  # 0 in the warm start
                if state is not None:  # the adaptive rule's state waits: it starts fresh after the warm start
                    assert torch.equal(layer.router.bias_step_E, state[i][0])
                    assert torch.equal(layer.router.bias_sign_E, state[i][1])
            elif state is not None:
                want, step_E, sign_E = balance.adaptive_bias_update(before[i], *state[i], seen["counts_LE"][i], rate)
                assert torch.equal(layer.router.bias_step_E, step_E) and torch.equal(layer.router.bias_sign_E, sign_E)
            else:
                want = balance.bias_update(before[i], seen["counts_LE"][i], rate, bal.bias_update_rule)
            # the same functions on the same tensors: bit for bit
            assert torch.equal(layer.router.expert_bias, want), (rule, step, i)
            assert not torch.equal(layer.router.expert_bias, before[i])  # it did move
    # the lr schedule: full steps through the warm-up, then smaller ones as the lr decays
    if bal.bias_rate_schedule == "lr":
        assert scales[:t.warmup_steps] == [1.0] * t.warmup_steps and 0 < scales[-1] < 1
    else:
        assert scales == [1.0] * 5


@pytest.mark.slow  # two short trainings and a resume (~30 s on a quiet 2-core machine)
@pytest.mark.parametrize("rule", ["quantile_ema", "adaptive"])
def test_resume_continues_the_new_rules_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    rule: str) -> None:
    # quantile EMA: the new bias depends on the old one, so a bias not restored exactly would show in
    # every later loss and routing row (the proportional rule shares the path: a buffer the
    # checkpoint holds, moved in TrainHealth.end_step); adaptive: its step and last sign as well
    extra = RULES[rule] + ("train.steps=8", "train.ckpt_every=4", "train.eval_every=8")
    check_crash_resume(tmp_path, extra, 6, 4, monkeypatch)
