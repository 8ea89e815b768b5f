"""`dropless train --replay-routing RECORD`: the trainer learns from a record's sequences through the
record's experts, refuses a record of another model, pads unequal sequences without touching the real
tokens, and resumes at the same place in the record."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dropless.expert_slots import ExpertSlots
from dropless.model import MoEModel
from dropless.data.routing_record import RoutingRecord
from dropless.train.loop import Trainer
from dropless.data.replay import IGNORE_INDEX, ReplayData
from dropless.train.run import main as train_main
from tiny_run import TINY, check_crash_resume, rows, tiny
from tolerances import REFERENCE

CFG = ["model.n_layers=3", "train.steps=8", "train.eval_every=100", "train.ckpt_every=100"]  # MoE blocks 1, 2
TEXT = (b"Routing replay trains the policy through the experts that generated its samples. "
        b"The router still learns from its scores at the recorded experts. ") * 4


def text_sequences(n: int, length: int, stride: int = 7) -> list[torch.Tensor]:
    data = torch.tensor(list(TEXT))
    return [data[i * stride:i * stride + length] for i in range(n)]


def expert_01_record(path: Path, lengths: list[int] | None = None, **model: str) -> RoutingRecord:
    """Every token of every layer on experts 0..K-1: routing no learned router would produce."""
    cfg = tiny(*CFG, *model.values()).model
    seqs = text_sequences(6, 33) if lengths is None else [text_sequences(1, n)[0] for n in lengths]
    K = cfg.moe.top_k
    ids = [torch.arange(K).expand(cfg.n_moe_layers, s.numel(), K) for s in seqs]
    rec = RoutingRecord.for_model(MoEModel(cfg), seqs, ids, "hand-made: experts 0 and 1")
    rec.save(path)
    return rec


def test_training_uses_the_recorded_ids(tmp_path: Path) -> None:
    expert_01_record(tmp_path / "r.rec")
    run = tmp_path / "run"
    summary = Trainer(tiny(*CFG, f"data.replay_routing={tmp_path / 'r.rec'}"), run).fit()
    routing = [json.loads(line) for line in (run / "routing.jsonl").read_text().splitlines()]
    assert len(routing) == 8
    for row in routing:
        for layer in row["layers"]:  # the step's own routing: every pair on experts 0 and 1
            assert layer["counts"][2:] == [0, 0] and layer["counts"][0] == layer["counts"][1] == 4 * 32
    losses = [r["loss"] for r in rows(run, "loss")]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert math.isfinite(summary["final_val_loss"])


def test_a_record_of_another_model_is_refused_and_nothing_is_written(tmp_path: Path, capsys) -> None:
    expert_01_record(tmp_path / "k1.rec", k="model.moe.top_k=1")
    with pytest.raises(ValueError, match="header field top_k=1 does not match the model's model.moe.top_k"):
        Trainer(tiny(*CFG, f"data.replay_routing={tmp_path / 'k1.rec'}"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    expert_01_record(tmp_path / "l.rec", n="model.n_layers=4")
    sets = [a for s in TINY + CFG for a in ("--set", s)]
    code = train_main([*sets, "--run-dir", str(tmp_path / "run2"), "--replay-routing", str(tmp_path / "l.rec")])
    assert code == 2
    assert "header field moe_layers=[1, 2, 3]" in capsys.readouterr().err
    assert not (tmp_path / "run2").exists()
    with pytest.raises(ValueError, match="model.moe.router.strategy='expert_choice'"):
        ReplayData(tmp_path / "k1.rec", tiny(*CFG, "model.moe.router.strategy=expert_choice"),
                   ExpertSlots(4), torch.device("cpu"))


def test_padding_leaves_the_real_tokens_alone(tmp_path: Path) -> None:
    cfg = tiny(*CFG, "train.batch_size=3")
    rec = expert_01_record(tmp_path / "r.rec", lengths=[33, 12, 20])
    # the sampler's case: the last token of the second sequence was never routed
    rec.ids[1] = rec.ids[1][:, :11]
    rec.save(tmp_path / "r.rec")
    data = ReplayData(tmp_path / "r.rec", cfg, ExpertSlots.from_config(cfg.model.moe), torch.device("cpu"))
    x, y, ids = data.batch(0, 0)
    assert x.shape == y.shape == (3, 32) and [i.shape for i in ids] == [(3, 32, 2)] * 2
    torch.manual_seed(0)
    model = MoEModel(cfg.model)
    with torch.no_grad():
        out = model(x, y, replay_ids=ids)
    n_real, ce_sum = 0, 0.0
    for b, i in enumerate(data.indices(0, 0)):
        xs, ys, ids_LSK = data.seqs[i]
        n = xs.numel()
        assert n == {0: 32, 1: 11, 2: 19}[i]  # min(routed, tokens - 1) inputs
        assert torch.equal(x[b, :n], xs) and torch.equal(y[b, :n], ys)
        assert (y[b, n:] == IGNORE_INDEX).all()
        with torch.no_grad():
            alone = model(xs[None], ys[None], replay_ids=[l[None] for l in ids_LSK])
        tol = REFERENCE[torch.float32]  # another batch composition: GEMM rows may round differently
        torch.testing.assert_close(out.logits[b, :n], alone.logits[0], rtol=tol.rtol, atol=tol.atol)
        n_real, ce_sum = n_real + n, ce_sum + float(alone.ce_loss) * n
    # cross-entropy is the mean over the real targets only
    assert float(out.ce_loss) == pytest.approx(ce_sum / n_real, rel=1e-5)


def test_order_visits_every_sequence_once_per_epoch_and_restarts_with_a_new_record(tmp_path: Path) -> None:
    cfg = tiny(*CFG, "train.batch_size=2", "train.grad_accum=2")
    expert_01_record(tmp_path / "r.rec", lengths=[33, 30, 25, 20, 15])
    data = ReplayData(tmp_path / "r.rec", cfg, ExpertSlots.from_config(cfg.model.moe), torch.device("cpu"))
    seen = [i for step in range(5) for m in range(2) for i in data.indices(step, m)]  # 20 = 4 epochs
    for e in range(4):
        assert sorted(seen[5 * e:5 * e + 5]) == list(range(5))
    assert seen[:5] != seen[5:10] or seen[5:10] != seen[10:15]  # reshuffled per epoch
    state = data.state_dict()
    again = ReplayData(tmp_path / "r.rec", cfg, ExpertSlots.from_config(cfg.model.moe), torch.device("cpu"))
    assert again.resume(state, 3) is None and again.indices(3, 1) == data.indices(3, 1)
    assert again.resume({"fingerprint": "another", "start_step": 0}, 3) is not None
    assert again.indices(3, 0) == data.indices(0, 0)  # a new record starts from its first batch


@pytest.mark.slow
def test_a_resumed_replay_run_continues_where_the_uninterrupted_run_was(tmp_path: Path, monkeypatch) -> None:
    expert_01_record(tmp_path / "r.rec", lengths=[33, 30, 25, 20, 15, 33, 28])
    extra = (*CFG, f"data.replay_routing={tmp_path / 'r.rec'}", "train.steps=10", "train.ckpt_every=5")
    check_crash_resume(tmp_path, extra, 7, 5, monkeypatch)


def test_rl_loop_resumes_a_trained_run_on_a_new_record(tmp_path: Path, capsys) -> None:
    """The RL workflow: a run trained (here on its data split) to step 4 continues on a rollout's
    record with `--resume --replay-routing`; the record starts at the resumed step."""
    run = tmp_path / "run"
    Trainer(tiny(*CFG, "train.steps=4", "train.ckpt_every=4"), run).fit()
    expert_01_record(tmp_path / "r.rec")
    sets = [a for s in TINY + CFG for a in ("--set", s)]
    assert train_main([*sets, "--run-dir", str(run), "--resume", "--replay-routing", str(tmp_path / "r.rec"),
                       "--set", "train.steps=6"]) == 0
    out = capsys.readouterr().out
    assert "it starts at step 4 from its first sequence" in out
    routing = [json.loads(line) for line in (run / "routing.jsonl").read_text().splitlines()]
    assert [r["step"] for r in routing] == [0, 1, 2, 3, 4, 5]
    assert all(layer["counts"][2:] != [0, 0] for r in routing[:4] for layer in r["layers"])
    assert all(layer["counts"][2:] == [0, 0] for r in routing[4:] for layer in r["layers"])


def test_a_norm_top_k_run_is_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    """norm_top_k's denominator is the mass of the router's own top norm_top_k, which a replayed choice
    does not give (layers/router.py): refused when the trainer starts, not at the first step."""
    expert_01_record(tmp_path / "r.rec")
    sets = [a for s in [*TINY, *CFG, "model.moe.router.norm_top_k=3"] for a in ("--set", s)]
    code = train_main([*sets, "--run-dir", str(tmp_path / "run"), "--replay-routing", str(tmp_path / "r.rec")])
    assert code == 2
    err = capsys.readouterr().err
    assert "model.moe.router.norm_top_k=3" in err and "data.replay_routing=" in err, err
    assert not (tmp_path / "run").exists()

