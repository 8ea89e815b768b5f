"""Resume as a user expects: the run's own config, what may change, one checkpoint format, exact
routing logs whatever ckpt_every and log_every are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dropless.config import load_config, save_config, to_dict
from dropless.monitor.stats import StepAccumulator
from dropless.runs import checkpoint as ckpt
from dropless.runs import dist_checkpoint
from dropless.runs.load import load_model
from dropless.train.loop import Trainer
from dropless.runs.resume import check_resume_config
from dropless.train import run as run_module
from dropless.train.run import main as train_main
from tiny_run import check_crash_resume, crash_at, rows, tiny


# -- the routing log's running sums are part of the checkpoint ------------------------------------

def test_routing_log_is_exact_when_a_checkpoint_falls_inside_a_log_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # log steps 0, 2, 5, 8, 11; checkpoints after steps 5, 10, 12: the step-10 checkpoint holds step 9
    # of the interval 9..11, which the step-11 row must still count after a resume
    extra = ("train.steps=12", "log.log_every=3", "train.ckpt_every=5", "train.keep_last=5")
    # every routing row (counts, sums, maxvio, flip rates) as the uninterrupted run wrote it
    check_crash_resume(tmp_path, extra, 11, 10, monkeypatch)


def _accumulator(seed: int) -> StepAccumulator:
    """An accumulator holding arbitrary interval sums, as a rank has them between log steps."""
    g = torch.Generator().manual_seed(seed)
    acc = StepAccumulator(num_layers=2, num_experts=4, top_k=2)
    # tensors that already span all ranks (op "global") hold the same values on every rank
    same = {n for n, (_, op) in acc.interval_tensors().items() if op == "global"}
    state = {n: torch.randint(0, 50, t.shape, generator=torch.Generator().manual_seed(99) if n in same else g)
             .float() for n, t in acc.state_dict().items()}
    state["step_counts_LE"].zero_()  # between steps
    acc.load_state_dict(state)
    return acc


def _record(accs: list[StepAccumulator]) -> dict:
    """What `record` writes after the all-reduce over the ranks holding `accs` (in one process)."""
    for name, (_, op) in accs[0].interval_tensors().items():
        if op == "global":  # already the same on every rank: record leaves them alone
            continue
        stacked = torch.stack([getattr(a, name) for a in accs])
        total = stacked.sum(0) if op == "sum" else stacked.amax(0)
        for a in accs:
            getattr(a, name).copy_(total)
    return accs[0].record(7)


@pytest.mark.parametrize("new_world", [1, 2, 3])
def test_accumulator_state_reshards_to_another_world_size(new_world: int) -> None:
    # saved by 2 ranks; resumed at 1, 2 (each its own) and 3 ranks: the routing row is the same
    saved = [_accumulator(0).state_dict(), _accumulator(1).state_dict()]
    expected = _record([_accumulator(0), _accumulator(1)])
    resumed = []
    for rank in range(new_world):
        acc = StepAccumulator(num_layers=2, num_experts=4, top_k=2)
        acc.load_state_dict(acc.state_for_rank(saved, rank, new_world))
        resumed.append(acc)
    assert _record(resumed) == expected
    with pytest.raises(ValueError, match="has shape"):
        StepAccumulator(num_layers=3, num_experts=4, top_k=2).load_state_dict(saved[0])


# -- the run's own config, and what a resume may change -------------------------------------------

@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_test.toml"
    save_config(tiny("train.ckpt_every=2", "train.keep_last=5"), path)
    return path


def test_resume_continues_with_the_runs_own_config(tmp_path: Path, config_file: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    # The README's example: a run started with overrides, resumed with nothing but --run-dir --resume,
    # continues with those overrides (top_k=1, 4 steps), bit for bit like the uninterrupted run.
    full, run = tmp_path / "full", tmp_path / "k1"
    start = ["--config", str(config_file), "--set", "train.steps=4", "--set", "model.moe.top_k=1"]
    assert train_main([*start, "--run-dir", str(full)]) == 0
    summary = (full / "summary.json").read_text()
    capsys.readouterr()
    assert train_main(["--run-dir", str(full), "--resume"]) == 0  # a finished run: nothing to do
    assert "nothing to train: the run is complete at step 4" in capsys.readouterr().out
    assert (full / "summary.json").read_text() == summary
    assert train_main([*start, "--run-dir", str(run)]) == 0
    shutil.rmtree(run / "checkpoints" / ckpt.checkpoint_name(4))  # as if killed before that save
    assert train_main(["--run-dir", str(run), "--resume"]) == 0
    assert rows(full, "loss") == rows(run, "loss")
    assert (full / "routing.jsonl").read_text() == (run / "routing.jsonl").read_text()
    assert load_config(run / "config.toml").model.moe.top_k == 1
    resumed = rows(run, "resumed_from")
    assert [(r["step"], r["resumed_from"], r["config_changes"]) for r in resumed] == [(2, "step_000002", {})]

    # A longer run: train.steps may change, and the change is printed and logged.
    capsys.readouterr()
    assert train_main(["--run-dir", str(run), "--resume", "--set", "train.steps=6"]) == 0
    assert "config change on resume: train.steps: 4 -> 6" in capsys.readouterr().out
    assert rows(run, "resumed_from")[-1]["config_changes"] == {"train.steps": [4, 6]}
    assert [r["step"] for r in rows(run, "loss")] == list(range(6))
    assert load_config(run / "config.toml").train.steps == 6
    routing = [json.loads(line) for line in (run / "routing.jsonl").read_text().splitlines()]
    assert {layer["top_k"] for r in routing for layer in r["layers"]} == {1}


def test_resume_refuses_a_change_of_the_models_shape_or_routing(tmp_path: Path, config_file: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert train_main(["--config", str(config_file), "--set", "train.steps=4", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    for field, new, old in (("model.moe.top_k", "1", "2"), ("model.d_model", "64", "32"),
                            ("model.moe.router.score_func", "'sigmoid'", "'softmax'")):
        value = new.strip("'")
        assert train_main(["--run-dir", str(run), "--resume", "--set", f"{field}={value}",
                           "--set", "train.steps=6"]) == 2
        err = capsys.readouterr().err
        assert f"{field}={new}" in err and f"trained with {field}={old}" in err, err
    assert train_main(["--run-dir", str(run), "--resume", "--set", "train.steps=3"]) == 2
    assert "train.steps=3: the checkpoint is already at step 4" in capsys.readouterr().err
    # the Python API checks the same (the checkpoint's config is the reference)
    with pytest.raises(ValueError, match="model.moe.num_experts=8"):
        Trainer(tiny("train.steps=6", "model.moe.num_experts=8"), run, resume=True)
    assert load_config(run / "config.toml").train.steps == 4  # nothing was written by the refusals


def test_resume_allows_the_documented_model_fields_and_logs_every_change(
        tmp_path: Path, config_file: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert train_main(["--config", str(config_file), "--set", "train.steps=2", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    changes = ["model.moe.backend=loop", "model.moe.balance.aux_loss_coeff=0.02", "train.lr=0.005",
               "train.steps=4", "log.log_every=2"]
    assert train_main(["--run-dir", str(run), "--resume", *sum((["--set", c] for c in changes), [])]) == 0
    out = capsys.readouterr().out
    logged = rows(run, "resumed_from")[-1]["config_changes"]
    assert logged == {"log.log_every": [1, 2], "model.moe.backend": ["auto", "loop"],
                      "model.moe.balance.aux_loss_coeff": [0.01, 0.02], "train.lr": [0.01, 0.005],
                      "train.steps": [2, 4]}
    assert all(f"config change on resume: {name}" in out for name in logged)


def test_resume_rules_field_by_field() -> None:
    saved = to_dict(tiny())
    # numerics and objective may change: the same network, computed or trained differently
    assert check_resume_config(saved, tiny("model.moe.precision=mxfp8", "model.moe.align=32",
                                           "model.init_std=0.01", "data.max_bytes=100000"), 10) == {
        "data.max_bytes": (200000, 100000), "model.init_std": (0.02, 0.01), "model.moe.align": (1, 32),
        "model.moe.precision": ("bf16", "mxfp8")}
    # what the network is, or what its input tokens mean, may not
    for change, message in (("model.moe.router.use_expert_bias=true", "model.moe.router.use_expert_bias=True"),
                            ("model.moe.capacity_factor=1.5", "model.moe.capacity_factor=1.5"),
                            ("model.rope_theta=500000", "model.rope_theta=500000.0"),
                            ("model.moe.n_shared_experts=1", "model.moe.n_shared_experts=1")):
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            check_resume_config(saved, tiny(change), 10)
    with pytest.raises(ValueError, match="data.tokenizer='hf'"):
        check_resume_config(saved, tiny("data.tokenizer=hf", "data.tokenizer_path=t.json"), 10)
    hf = to_dict(tiny("data.tokenizer=hf", "data.tokenizer_path=a/tokenizer.json"))
    with pytest.raises(ValueError, match=r"data\.tokenizer_path='b/tokenizer\.json'"):
        check_resume_config(hf, tiny("data.tokenizer=hf", "data.tokenizer_path=b/tokenizer.json"), 10)
    assert check_resume_config(saved, tiny(), 20) == {}  # a finished run resumes to nothing


def test_config_flag_is_ignored_on_resume_with_a_note(tmp_path: Path, config_file: Path,
                                                      capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    assert train_main(["--config", str(config_file), "--set", "train.steps=2", "--set", "model.moe.top_k=1",
                       "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert train_main(["--config", str(config_file), "--run-dir", str(run), "--resume",
                       "--set", "train.steps=3"]) == 0
    err = capsys.readouterr().err
    assert f"--config {config_file} is ignored on --resume" in err
    assert "model.moe.top_k (run: 1, --config: 2)" in err and "train.steps (run: 2, --config: 20)" in err
    assert load_config(run / "config.toml").model.moe.top_k == 1
    # a --config that matches the run's config says nothing
    assert train_main(["--config", str(run / "config.toml"), "--run-dir", str(run), "--resume"]) == 0
    assert "ignored" not in capsys.readouterr().err

    # --nproc: the launcher checks the config and says it once, then starts the ranks without --config
    launched: list[list[str]] = []
    monkeypatch.setattr(run_module.subprocess, "run",
                        lambda cmd, env: launched.append(cmd) or SimpleNamespace(returncode=0))
    assert train_main(["--nproc", "2", "--config", str(config_file), "--resume", "--run-dir", str(run),
                       "--set", "train.steps=5"]) == 0
    assert "is ignored on --resume" in capsys.readouterr().err
    cmd = launched[0]
    assert "--config" not in cmd and cmd[-2:] == ["--run-dir", str(run)]
    assert cmd[cmd.index("dropless.train") + 1:-2] == ["--resume", "--set", "train.steps=5"]
    assert train_main(["--nproc", "2", "--resume", "--run-dir", str(run), "--set", "model.moe.top_k=2"]) == 2
    assert len(launched) == 1  # refused before any process started


# -- one checkpoint format -------------------------------------------------------------------------

def test_one_process_writes_the_format_every_world_size_reads(tmp_path: Path) -> None:
    trainer = Trainer(tiny("train.steps=2", "train.ckpt_every=2"), tmp_path)
    trainer.fit()
    path = ckpt.latest_checkpoint(tmp_path)
    assert ckpt.is_dcp_checkpoint(path) and not (path / ckpt.STATE_FILE).exists()
    state = dist_checkpoint.trainer_state(path)
    assert state["step"] == 2 and state["world_size"] == 1 and state["config"] == to_dict(trainer.cfg)
    assert len(state["health"]["acc"]) == 1  # one accumulator state per rank that wrote it
    model, _ = load_model(tmp_path)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_older_one_process_checkpoints_still_resume_and_generate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = tmp_path / "full"
    Trainer(tiny("train.steps=12"), full).fit()
    # the format one process wrote before: one torch.save file with model and optimizer inside
    dcp_run = tmp_path / "dcp"
    crash_at(Trainer(tiny("train.steps=12"), dcp_run), 11, monkeypatch)
    saved = dist_checkpoint.trainer_state(ckpt.latest_checkpoint(dcp_run))
    loaded = Trainer(tiny("train.steps=12"), dcp_run, resume=True)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("metrics.jsonl", "routing.jsonl", "config.toml"):
        shutil.copy(dcp_run / name, legacy / name)
    ckpt.save_checkpoint(legacy, 10, {
        "step": 10, "rng": saved["rng"], "config": saved["config"],
        "health": {"prev_probe_ids": saved["health"]["prev_probe_ids"]},
        "model": loaded.model.state_dict(), "optimizer": loaded.optimizer.state_dict()})
    model, _ = load_model(legacy)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in loaded.model.state_dict().items())
    Trainer(tiny("train.steps=12"), legacy, resume=True).fit()
    assert rows(full, "loss") == rows(legacy, "loss")
    assert ckpt.is_dcp_checkpoint(ckpt.latest_checkpoint(legacy))  # its next checkpoint: the new format
