"""Non-finite steps (train/nonfinite.py): skipped on the device with nothing changed, counted, reported,
and a streak stops the run with a good last checkpoint.

NaN is injected by a forward hook on the final norm that multiplies its output by NaN while `POISON`
is set: the loss and every gradient become NaN, as a real overflow would make them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dropless.monitor.report import write_report
from dropless.model import MoEModel
from dropless.runs import checkpoint as ckpt
from dropless.runs.dist_checkpoint import load_full_model
from dropless.train.loop import Trainer
from dropless.train.nonfinite import NonFiniteError
from dropless.train.optim import build_optimizer, step_unless
from host_sync import forbid_host_sync
from tiny_run import crash_at, tiny

# Every router-buffer rule, each with an optimizer: the loss-free bias moves the bias every step, so
# does quantile balancing, and expert_threshold moves its thresholds (and their `ready` flag).
BUFFER_RULES = {
    "bias": ("model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0.01"),
    "quantile": ("model.moe.router.use_expert_bias=true", "model.moe.balance.quantile_balance=true",
                 "train.optimizer=adamw_bf16"),
    "threshold": ("model.moe.router.strategy=expert_threshold",),
}


def poison(trainer: Trainer, steps: set[int] | None = None) -> dict:
    """Make the forward NaN while state["on"], or at the optimizer steps in `steps` during fit()."""
    state = {"on": False}
    trainer.model.norm.register_forward_hook(
        lambda mod, args, out: out * float("nan") if state["on"] else out)
    if steps is not None:
        step_fn = trainer.train_step

        def train_step(step: int, log_step: bool = False):
            state["on"] = step in steps
            try:
                return step_fn(step, log_step)
            finally:
                state["on"] = False

        trainer.train_step = train_step  # type: ignore[method-assign]
    return state


def everything(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Parameters, optimizer state and buffers, copied."""
    out = {f"param.{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    out.update({f"buffer.{n}": b.clone() for n, b in trainer.model.named_buffers()})
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for p, st in trainer.optimizer.state.items():
        for k, v in st.items():
            out[f"opt.{names[id(p)]}.{k}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def router_buffers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith("buffer.") and "router" in k
            and "hash" not in k}


@pytest.mark.parametrize("rule", sorted(BUFFER_RULES))
def test_nonfinite_step_changes_nothing(tmp_path: Path, rule: str) -> None:
    trainer = Trainer(tiny(*BUFFER_RULES[rule]), tmp_path)
    state = poison(trainer)
    for step in range(2):
        trainer.train_step(step)
    before = everything(trainer)
    assert router_buffers(before)  # the rule under test has buffers to protect
    state["on"] = True
    sums, grad_norm = trainer.train_step(2)
    state["on"] = False
    assert not torch.isfinite(sums.loss) and not torch.isfinite(grad_norm)
    after = everything(trainer)
    assert after.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == [], changed
    # the next good step moves parameters, optimizer state and the router buffers again
    trainer.train_step(3)
    moved = everything(trainer)
    assert all(not torch.equal(after[k], moved[k]) for k, v in router_buffers(after).items()
               if v.is_floating_point()), rule
    assert not torch.equal(after["param.embed.weight"], moved["param.embed.weight"])
    row = trainer.health.record(3, trainer.layout.placement.autocast(), tmp_path)
    assert row["nonfinite_steps"] == 1 and row["skipped_steps"] == 1
    for layer in row["layers"]:  # the skipped step left the counts: steps 0, 1 and 3 remain
        assert sum(layer["counts"]) == 3 * 4 * 32 * 2 or rule == "threshold"
        assert all(v == v for v in layer.values() if isinstance(v, float))  # no NaN leaked in


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_bf16"])
def test_a_step_with_the_guard_reads_nothing_on_the_host(tmp_path: Path, optimizer: str) -> None:
    """The flag, the skip (optimizer and router buffers) and the counters stay on the device: a whole
    non-log training step, skipped or not, makes no host read (a GPU would sync on one)."""
    trainer = Trainer(tiny(*BUFFER_RULES["bias"], f"train.optimizer={optimizer}"), tmp_path)
    state = poison(trainer)
    trainer.train_step(0)
    with forbid_host_sync("host read in a training step"):
        trainer.train_step(1)
        state["on"] = True
        trainer.train_step(2)
    trainer.nonfinite.read()
    assert trainer.nonfinite.take() == 1


def test_skipped_first_step_leaves_thresholds_unset(tmp_path: Path) -> None:
    """expert_threshold's first update sets the thresholds outright and marks them ready; skipped, it
    must leave both as they were (ready False: the next good step sets them outright)."""
    trainer = Trainer(tiny(*BUFFER_RULES["threshold"]), tmp_path)
    poison(trainer)["on"] = True
    before = router_buffers(everything(trainer))
    trainer.train_step(0)
    after = router_buffers(everything(trainer))
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(v.item() for k, v in after.items() if k.endswith("threshold_ready"))


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_bf16"])
def test_optimizer_skip_is_bit_exact(optimizer: str) -> None:
    """A skipped step leaves the optimizer as if it never happened: the step after it equals, bit for
    bit, the step of an optimizer that never saw it (so the step count did not advance either)."""
    torch.manual_seed(0)
    cfg = tiny(f"train.optimizer={optimizer}").train
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [build_optimizer(m, cfg) for m in models]
    grads = [[torch.randn_like(p) for p in models[0].parameters()] for _ in range(3)]

    def step(i: int, g: list[torch.Tensor], skip: bool | None) -> None:
        for p, gp in zip(models[i].parameters(), g):
            p.grad = gp.clone()
        step_unless(opts[i], None if skip is None else torch.tensor(skip))

    step(0, grads[0], False)
    step(1, grads[0], None)
    step(0, [torch.full_like(g, float("nan")) for g in grads[1]], True)  # skipped
    step(0, grads[2], False)
    step(1, grads[2], None)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opts[0].state.values(), opts[1].state.values()):
        assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def test_one_bad_step_is_counted_and_reported(tmp_path: Path) -> None:
    trainer = Trainer(tiny("train.steps=6", "train.ckpt_every=3"), tmp_path)
    poison(trainer, steps={2})
    summary = trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "loss" in r}
    assert [by_step[s]["nonfinite_steps"] for s in range(6)] == [0, 0, 1, 0, 0, 0]
    assert by_step[2]["loss"] != by_step[2]["loss"]  # the row tells the truth: NaN
    assert summary["nonfinite_steps"] == 1 and summary["final_val_loss"] < 6
    routing = [json.loads(line) for line in (tmp_path / "routing.jsonl").read_text().splitlines()]
    assert [r["nonfinite_steps"] for r in routing] == [0, 0, 1, 0, 0, 0]
    alarms = [json.loads(line) for line in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert [(a["kind"], a["step"], a["layer"]) for a in alarms if a["kind"] == "nonfinite"] == [
        ("nonfinite", 2, None)]
    report = write_report(tmp_path).read_text()
    assert "of which 1 for a non-finite loss" in report and "| nonfinite |" in report


def test_a_streak_stops_the_run_with_a_good_checkpoint(tmp_path: Path) -> None:
    # Log steps 0, 3, 7, 11; checkpoints after every second step. Steps 3.. are bad: step 3 is read
    # at its log step (streak 1, checkpoint 4 written), the streak 3, 4, 5 at the read before
    # checkpoint 6, which is not written.
    cfg = tiny("train.steps=12", "train.ckpt_every=2", "train.max_nonfinite_steps=3", "log.log_every=4",
               "train.keep_last=10")
    trainer = Trainer(cfg, tmp_path)
    poison(trainer, steps={3, 4, 5, 6, 7, 8, 9, 10, 11})
    with pytest.raises(NonFiniteError, match=r"3 consecutive optimizer steps.*max_nonfinite_steps=3"):
        trainer.fit()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == [ckpt.checkpoint_name(2), ckpt.checkpoint_name(4)]
    loaded = MoEModel(cfg.model)
    load_full_model(ckpt.latest_checkpoint(tmp_path), loaded)
    last = loaded.state_dict()
    assert all(torch.isfinite(v).all() for v in last.values() if v.is_floating_point())
    # steps 3.. changed nothing: the model the run stopped with is the last checkpoint's, bit for bit
    assert all(torch.equal(v, last[k]) for k, v in trainer.model.state_dict().items())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_steps"] for r in rows if "loss" in r] == [0, 1]  # logged at steps 0 and 3


@pytest.mark.parametrize("skip_first", [True, False])
def test_optimizers_without_found_inf_skip_by_undoing_the_step(skip_first: bool) -> None:
    # foreach AdamW (what `meta` and devices without fused kernels get) ignores found_inf: the step is
    # undone on the device. A skipped step leaves parameter and state bit-identical (a skipped first
    # step leaves the state of an optimizer never stepped), and the next step equals an optimizer that
    # never saw the skipped one.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3, 4))
    q = torch.nn.Parameter(p.detach().clone())
    opt, ref = torch.optim.AdamW([p], foreach=True), torch.optim.AdamW([q], foreach=True)
    g = torch.randn(3, 4)
    if not skip_first:
        p.grad, q.grad = g.clone(), g.clone()
        step_unless(opt, torch.tensor(False))
        ref.step()
    before = p.detach().clone()
    state = {k: v.clone() for k, v in opt.state.get(p, {}).items()}
    p.grad = torch.full((3, 4), float("nan"))
    step_unless(opt, torch.tensor(True))
    assert torch.equal(p, before)
    for k, v in opt.state[p].items():
        assert torch.equal(v, state[k]) if state else not v.any(), k
    p.grad, q.grad = g.clone(), g.clone()
    step_unless(opt, torch.tensor(False))
    ref.step()
    assert torch.equal(p, q)


def test_a_streak_across_a_resume_stops_where_the_uninterrupted_run_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As above (steps 3.. bad, checkpoints every 2 steps, stop after 3 in a row), but the run dies
    # during step 5 and resumes from checkpoint 4, which holds a streak of 1 (step 3): steps 4 and 5
    # make it 3 at the read before checkpoint 6, as without the crash. A streak restarted at 0 would
    # write checkpoint 6 and run on.
    extra = ("train.steps=12", "train.ckpt_every=2", "train.max_nonfinite_steps=3", "log.log_every=4",
             "train.keep_last=10")
    first = Trainer(tiny(*extra), tmp_path)
    poison(first, steps=set(range(3, 12)))
    crash_at(first, 5, monkeypatch)
    assert ckpt.latest_checkpoint(tmp_path).name == ckpt.checkpoint_name(4)
    resumed = Trainer(tiny(*extra), tmp_path, resume=True)
    poison(resumed, steps=set(range(3, 12)))
    with pytest.raises(NonFiniteError, match=r"3 consecutive optimizer steps"):
        resumed.fit()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved == [ckpt.checkpoint_name(2), ckpt.checkpoint_name(4)]
