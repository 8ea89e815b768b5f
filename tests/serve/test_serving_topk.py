"""Serving with fewer experts: the config map (serve/serving.py), a trained run loaded through it, and
the MoE layer it builds against a per-token reference, and `dropless evaluate`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dropless import cli
from dropless.config import ModelConfig, MoEConfig, RouterConfig
from dropless.layers.moe import MoELayer
from dropless.ops.activations import activation
from dropless.serve import evaluate_cli
from dropless.serve.evaluate import val_loss
from dropless.runs.load import load_model
from dropless.serve.serving import serving_map, serving_top_k, weight_denominator
from dropless.train.loop import Trainer
from tiny_run import tiny
from tolerances import assert_close


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run (E=4, top-2), trained a few steps so the router is not at its initialisation."""
    path = tmp_path_factory.mktemp("run")
    Trainer(tiny("train.steps=6", "train.ckpt_every=6", "train.eval_every=6"), path).fit()
    return path


def model_cfg(**router: object) -> ModelConfig:
    moe = dict(num_experts=8, top_k=4, d_expert=16)
    moe.update({k: router.pop(k) for k in list(router) if k in ("num_experts", "top_k")})
    return ModelConfig(d_model=32, n_layers=2, n_heads=2, moe=MoEConfig(**moe, router=RouterConfig(**router)))


def test_map_mass_and_kept() -> None:
    cfg = model_cfg()
    served = serving_top_k(cfg, 2)  # K2 defaults to the trained k
    assert served.moe.top_k == 2 and served.moe.router.norm_top_k == 4 and weight_denominator(served) == 4
    assert served.moe.router.renormalize and cfg.moe.top_k == 4  # the trained config is not mutated
    assert serving_top_k(cfg, 2, 8).moe.router.norm_top_k == 8
    assert serving_top_k(cfg, 2, 2).moe.router.norm_top_k is None  # K2 = K1 > 1: the plain rule at K1
    kept = serving_top_k(cfg, 2, renorm="kept")
    assert kept.moe.top_k == 2 and kept.moe.router.norm_top_k is None and kept.moe.router.renormalize
    # at K1 = 1 the plain rule would keep the raw probability; kept (and mass K2 = 1) normalise it to 1
    assert serving_top_k(cfg, 1, renorm="kept").moe.router.norm_top_k == 1
    assert serving_top_k(cfg, 1, 1).moe.router.norm_top_k == 1
    # a model whose weights are the raw scores: K1 alone keeps each run expert's trained weight
    raw = model_cfg(renormalize=False)
    assert serving_top_k(raw, 1).moe.router == raw.moe.router and weight_denominator(raw) is None
    assert serving_top_k(raw, 1, renorm="kept").moe.router.norm_top_k == 1
    # the trained setting (and no setting at all) is the trained config itself
    assert serving_top_k(cfg, 4) is cfg and serving_top_k(cfg, 4, 4) is cfg and serving_top_k(cfg) is cfg
    assert serving_map() is None
    one = model_cfg(top_k=1)
    assert serving_top_k(one, 1) is one  # a top-1 model keeps its raw-probability weight
    # K1 > k: allowed (module note); the model's own rule at top_k = K1
    more = serving_top_k(cfg, 6)
    assert more.moe.top_k == 6 and more.moe.router.norm_top_k is None


@pytest.mark.parametrize("cfg_kw,args,match", [
    ({}, dict(k1=0), r"--serve-top-k=0 \(k1\): must be an integer >= 1"),
    ({}, dict(k1=9), r"--serve-top-k=9 \(k1\): exceeds model.moe.num_experts=8"),
    ({}, dict(k1=2, k2=1), r"--serve-norm-top-k=1 \(k2\): must be >= --serve-top-k=2"),
    ({}, dict(k1=2, k2=9), r"--serve-norm-top-k=9 \(k2\): exceeds model.moe.num_experts=8"),
    ({}, dict(k1=2, k2=4, renorm="kept"), r"--serve-norm-top-k=4 \(k2\): --serve-renorm=kept"),
    ({}, dict(k1=2, renorm="sum"), r"--serve-renorm='sum' \(renorm\)"),
    (dict(renormalize=False), dict(k1=2, k2=4), r"--serve-norm-top-k=4 \(k2\): the model's weights are"),
    (dict(strategy="hash"), dict(k1=2), r"model.moe.router.strategy='hash'"),
    (dict(strategy="expert_choice"), dict(k1=2), r"model.moe.router.strategy='expert_choice'"),
    (dict(n_groups=4, topk_groups=2), dict(k1=2, k2=6), r"--serve-norm-top-k=6: exceeds the 4 experts"),
    (dict(norm_top_k=6), dict(k1=2), r"model.moe.router.norm_top_k=6: the run already serves"),
])
def test_map_refuses(cfg_kw: dict, args: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        serving_top_k(model_cfg(**cfg_kw), **args)


def test_flag_checks_need_no_model() -> None:
    with pytest.raises(ValueError, match=r"--serve-norm-top-k=1 \(k2\): must be >= --serve-top-k=3"):
        serving_map(3, 1)


def test_k1_equal_k_reproduces_the_trained_logits(run_dir: Path) -> None:
    """K1 = k with K2 = k: the trained model's logits, bit for bit, through the serving map and through
    an explicit norm_top_k = k (which takes the K2 code path)."""
    trained, cfg = load_model(run_dir)
    k = cfg.model.moe.top_k
    x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    ref = trained(x).logits
    for fn in (serving_map(k, k), lambda m: replace(m, moe=replace(m.moe, router=replace(
            m.moe.router, norm_top_k=k)))):
        served, served_cfg = load_model(run_dir, model_cfg=fn)
        assert torch.equal(served(x).logits, ref)
    assert served_cfg.model.moe.router.norm_top_k == k  # the last one did take the K2 path


def test_fewer_experts_load_and_route_the_top_k1(run_dir: Path) -> None:
    """The checkpoint loads unchanged (same tensors) into the K1 = 1 model, which runs the trained
    model's first choice in every MoE layer of its first block (same input there) and changes the
    logits."""
    trained, _ = load_model(run_dir)
    served, cfg = load_model(run_dir, model_cfg=serving_map(1, 2))
    assert cfg.model.moe.top_k == 1 and cfg.model.moe.router.norm_top_k == 2
    a, b = trained.state_dict(), served.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    out_t, out_s = trained(x), served(x)
    assert torch.equal(out_s.moe[0].ids_TK, out_t.moe[0].ids_TK[:, :1])
    assert not torch.equal(out_s.logits, out_t.logits)


@pytest.mark.parametrize("score_func,pre_softmax", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_layer_runs_the_kept_experts_at_their_trained_weights(score_func: str, pre_softmax: bool) -> None:
    """K1 = 2 of a top-4 layer with K2 = 4: each token's output is its trained top-2 experts at their
    trained weights (a per-token loop over the trained layer's decision), shared expert included."""
    torch.manual_seed(0)
    trained_cfg = MoEConfig(num_experts=8, top_k=4, d_expert=16, n_shared_experts=1,
                            router=RouterConfig(score_func=score_func, pre_softmax=pre_softmax,
                                                scaling_factor=2.5))
    trained = MoELayer(32, trained_cfg)
    served = MoELayer(32, serving_top_k(ModelConfig(d_model=32, moe=trained_cfg), 2).moe)
    served.load_state_dict(trained.state_dict())
    x_TD = torch.randn(11, 32)
    d = trained.router(x_TD)
    ex = trained.experts
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros(32)
        for j in range(2):
            e = int(d.ids_TK[t, j])
            h = activation(x_TD[t] @ ex.w_gate_up_EDF[e], ex.kind, ex.clamp, ex.softcap)
            acc = acc + d.weights_TK[t, j] * (h @ ex.w_down_EFD[e])
        rows.append(acc)
    ref = torch.stack(rows) + trained.shared(x_TD)
    assert_close(served(x_TD).y, ref, msg="K1=2 of top-4")


def test_replay_refuses_a_k2_router() -> None:
    layer = MoELayer(32, MoEConfig(num_experts=8, top_k=2, d_expert=16, router=RouterConfig(norm_top_k=4)))
    with pytest.raises(ValueError, match=r"router.norm_top_k=4: routing replay"):
        layer(torch.randn(5, 32), replay_ids=torch.zeros(5, 2, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------
# `dropless evaluate`


def test_evaluate_one_setting(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Through the top-level CLI (the command is registered); the loss is serve.evaluate.val_loss of
    the model loaded with the same serving map, to the bit."""
    out = tmp_path / "one.json"
    assert cli.main(["evaluate", "--run-dir", str(run_dir), "--serve-top-k", "1", "--serve-norm-top-k", "2",
                     "--max-batches", "1", "--device", "cpu", "--json", str(out)]) == 0
    assert "val_loss" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    model, cfg = load_model(run_dir, model_cfg=serving_map(1, 2))
    assert (row["k1"], row["k2"], row["renorm"]) == (1, 2, "mass")
    assert row["val_loss"] == val_loss(model, cfg, max_batches=1)
    assert row["tokens"] == cfg.train.batch_size * cfg.train.seq_len


def test_evaluate_sweep(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sweep.json"
    assert evaluate_cli.main(["--run-dir", str(run_dir), "--serve-sweep", "--max-batches", "1",
                              "--device", "cpu", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    # top-2 of E=4: the trained k, then K1=1 with K2 in {1, 2, 4}; mass K2=1 is kept renormalisation
    assert [(r["k1"], r["k2"], r["names"]) for r in rows] == [
        (2, 2, ["trained"]), (1, 1, ["mass", "kept"]), (1, 2, ["mass"]), (1, 4, ["mass"])]
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == 1 + len(rows)
    trained, cfg = load_model(run_dir)
    assert rows[0]["val_loss"] == val_loss(trained, cfg, max_batches=1)
    w = [r["weight_sum"] for r in rows]
    assert w[0] == pytest.approx(1.0) and w[1] == pytest.approx(1.0) and 0 < w[3] < w[2] < 1
    assert len({r["val_loss"] for r in rows}) == len(rows)


@pytest.mark.parametrize("argv,match", [
    (["--serve-top-k", "9"], "--serve-top-k=9 (k1): exceeds model.moe.num_experts=4"),
    (["--serve-top-k", "2", "--serve-norm-top-k", "1"], "--serve-norm-top-k=1 (k2): must be >= --serve-top-k=2"),
    (["--serve-sweep", "--serve-top-k", "1"], "--serve-sweep: runs its own"),
    (["--max-batches", "0"], "--max-batches=0: must be >= 1"),
])
def test_evaluate_bad_input(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str],
                            match: str) -> None:
    out = tmp_path / "bad.json"
    assert evaluate_cli.main(["--run-dir", str(run_dir), "--json", str(out)] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless evaluate: error: ") and match in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_evaluate_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert evaluate_cli.main(["--run-dir", str(tmp_path / "nope")]) == 2
    assert "dropless evaluate: error: no complete checkpoint" in capsys.readouterr().err


def test_sweep_rows_stay_inside_the_experts_group_limited_routing_can_choose() -> None:
    """E=16, k=4, 4 groups of which 1 is eligible: 4 experts can be chosen, so K2 = 2k = 8 is not a
    row (serving_top_k refuses it, and one refused row used to end the whole sweep)."""
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, moe=MoEConfig(
        num_experts=16, top_k=4, d_expert=16, router=RouterConfig(n_groups=4, topk_groups=1)))
    rows = evaluate_cli.sweep_settings(cfg)
    assert all(k2 is None or k2 <= 4 for _, k2, _ in rows) and (1, 4, "mass") in rows
    for k1, k2, renorm in rows[1:]:
        serving_top_k(cfg, k1, k2, renorm)  # every row is a setting the serving map accepts
