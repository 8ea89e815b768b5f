"""`dropless diagnose` holds the balance alarms back for the run's learning-rate warm-up, as the trainer
does (replaying the rules over routing.jsonl without the warm-up would list `collapse` at steps 0
and 9 of a 50-step warm-up)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dropless.monitor.alarms import thresholds_for_run
from dropless.monitor.report import write_report
from dropless.train.loop import Trainer
from tiny_run import tiny


def test_report_keeps_balance_alarms_quiet_during_warmup(tmp_path: Path) -> None:
    # 8 experts, top-1, a bias that sends every token to expert 0: MaxVio 7, a collapse at every log
    # step, all of them inside the 3-step warm-up
    cfg = tiny("model.moe.num_experts=8", "model.moe.top_k=1", "model.moe.router.use_expert_bias=true",
               "train.steps=3", "train.warmup_steps=3")
    trainer = Trainer(cfg, tmp_path)
    for layer in trainer.model.moe_layers():
        layer.router.set_bias(torch.tensor([10.0] + [0.0] * 7))
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "routing.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(layer["maxvio_global"] > 2.0 for r in rows for layer in r["layers"])  # collapse-worthy
    assert not (tmp_path / "health.jsonl").exists()  # the trainer held them back
    assert thresholds_for_run(tmp_path).warmup_steps == 3
    report = write_report(tmp_path).read_text()
    assert "collapse" not in report, report
    assert "0 alarms" in report

    # the same record read as a run without warm-up (no config): the replay does flag the collapse
    (tmp_path / "config.toml").unlink()
    assert "| collapse |" in write_report(tmp_path).read_text()
