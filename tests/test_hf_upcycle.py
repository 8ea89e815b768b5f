"""Sparse upcycling of dense Qwen3 / Llama checkpoints (hf/upcycle.py, docs/models.md).

Dense checkpoints are tiny random-weight Qwen3ForCausalLM (grouped-query, q/k norm, explicit head_dim,
untied head) and LlamaForCausalLM (tied head) models built with transformers' own classes.

Tolerances: REFERENCE[fp32] where the same function is computed with products summed in another order
(a grouped expert GEMM vs the dense MLP's, softmax weights 1/K summed K times); the 1e-3 on the
loss curve (tests/tolerances.py UPCYCLE_LOSS_CURVE says why it is that loose).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_models import VOCAB, save_hf, transformers
from test_hf_cli import SMOKE, sets
from test_hf_parity import tokens
from tolerances import REFERENCE, UPCYCLE_LOSS_CURVE, assert_close

from dropless.cli import main as cli
from dropless.hf import import_hf, upcycle
from dropless.runs.load import load_model


def qwen3_dense(**kw: Any) -> Any:
    args = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
    args.update(kw)
    return transformers.Qwen3Config(**args)


def llama_dense(**kw: Any) -> Any:
    args = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                tie_word_embeddings=True)
    args.update(kw)
    return transformers.LlamaConfig(**args)


DENSE = {"qwen3": qwen3_dense, "llama": llama_dense}


@pytest.mark.parametrize("family", DENSE)
def test_dense_checkpoint_is_read_as_transformers_computes_it(tmp_path: Path, family: str) -> None:
    hf = save_hf(DENSE[family](), tmp_path, tokenizer=False)
    dense = upcycle.load_dense(tmp_path)
    assert dense.cfg.n_dense_layers == dense.cfg.n_layers
    x = tokens()
    with torch.no_grad():
        assert_close(dense(x).logits, hf(x).logits, REFERENCE[torch.float32], f"dense {family}")


@pytest.mark.parametrize("family,E,K", [("qwen3", 4, 2), ("llama", 5, 3), ("qwen3", 3, 3)])
def test_upcycled_output_equals_the_dense_output_at_init(tmp_path: Path, family: str, E: int, K: int) -> None:
    """G = 1: every expert is the dense MLP and the renormalised top-K softmax weights sum to 1, so
    the MoE model computes the dense model's logits whatever the (random) router chooses."""
    save_hf(DENSE[family](), tmp_path, tokenizer=False)
    dense = upcycle.load_dense(tmp_path, E, K)
    moe = upcycle.upcycle_model(dense, seed=1).eval()
    assert moe.cfg.n_moe_layers == moe.cfg.n_layers and moe.cfg.moe.num_experts == E
    x = tokens(seed=3)
    with torch.no_grad():
        out = moe(x)
        assert_close(out.logits, dense(x).logits, REFERENCE[torch.float32], f"upcycled {family} E={E} K={K}")
    assert (out.stats[0].tokens_per_expert_E > 0).sum() > 1  # the router really spreads the tokens
    router = moe.blocks[0].ffn.router.weight
    assert 0 < router.std() < 0.05  # small and random


def test_granular_slices_sum_to_the_dense_mlp(tmp_path: Path) -> None:
    """G = 2, E = 4 (two copies of each half of the hidden units, down scaled by 2): the K = 2
    experts that hold one copy of each half, with equal weights 1/2 (a zero router, renormalised),
    give the dense MLP; a random router's choice does not in general (module note)."""
    save_hf(qwen3_dense(), tmp_path, tokenizer=False)
    dense = upcycle.load_dense(tmp_path, 4, 2, granularity=2)
    moe = upcycle.upcycle_model(dense, granularity=2, seed=1).eval()
    assert moe.cfg.moe.d_expert == 24
    with torch.no_grad():
        for layer in moe.moe_layers():
            layer.router.weight.zero_()
    x = tokens(seed=5)
    for pair in ([0, 1], [3, 2], [0, 3]):  # slices (0, 1), (1, 0), (0, 1) from different copies
        ids = [torch.tensor(pair).expand(*x.shape, 2)] * moe.cfg.n_moe_layers
        with torch.no_grad():
            assert_close(moe(x, replay_ids=ids).logits, dense(x).logits, REFERENCE[torch.float32], f"experts {pair}")
    ids = [torch.tensor([0, 2]).expand(*x.shape, 2)] * moe.cfg.n_moe_layers  # slice 0 twice: not the MLP
    with torch.no_grad():
        assert not torch.allclose(moe(x, replay_ids=ids).logits, dense(x).logits, atol=1e-3)


def _dense_run(hf_dir: Path, out: Path, overrides: list[str]) -> None:
    """The dense checkpoint as a dropless run (all layers dense): the reference the upcycled run follows."""
    dense = upcycle.load_dense(hf_dir)
    cfg = import_hf.run_config(dense.cfg, out / "tokenizer" / "tokenizer.json", overrides)
    import_hf.save_run(dense, cfg, hf_dir, out.absolute(), {})


def test_one_expert_top1_follows_the_dense_loss_curve(tmp_path: Path) -> None:
    """The handbook's sanity check: upcycled to E = 1, top-1, trained 15 steps (fp32, the same data,
    seed and optimizer), the loss curve stays within 1e-3 of the dense model's. The z-loss is off on
    both (it is a loss on the router logit, an extra term the dense model has no counterpart of);
    the aux loss is on and constant (one expert: f = P = 1). Measured worst step difference 4.8e-7."""
    src = tmp_path / "src"
    save_hf(qwen3_dense(), src)
    train = [*SMOKE, "train.steps=15", "train.lr=3e-3", "log.log_every=1", "model.moe.balance.z_loss_coeff=0"]
    _dense_run(src, tmp_path / "dense", ["model.moe.balance.z_loss_coeff=0"])
    assert cli(["upcycle", str(src), "--experts", "1", "--top-k", "1", "--out", str(tmp_path / "moe"),
                "--set", "model.moe.balance.z_loss_coeff=0"]) == 0
    curves = []
    for run in ("dense", "moe"):
        assert cli(["train", "--run-dir", str(tmp_path / run), "--resume", *sets(*train)]) == 0
        rows = [json.loads(r) for r in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        curves.append(torch.tensor([r["ce_loss"] for r in rows if "ce_loss" in r and "loss" in r]))
    dense, moe = curves
    assert len(dense) == len(moe) == 15
    assert dense[-1] < dense[0] - 0.3  # it trains (measured 5.82 -> 5.16)
    assert (moe - dense).abs().max() <= UPCYCLE_LOSS_CURVE, (moe - dense).abs().max()


def test_upcycle_cli_writes_a_run_that_computes_the_dense_model(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    src, run = tmp_path / "src", tmp_path / "run"
    hf = save_hf(llama_dense(), src)
    run.mkdir()  # an empty --out folder is taken
    assert cli(["upcycle", str(src), "--experts", "4", "--top-k", "2", "--out", str(run)]) == 0
    out = capsys.readouterr().out
    assert "4 experts of width 40, top-2, granularity 1" in out and "balancing: aux loss 0.01; z-loss 0.001" in out
    model, cfg = load_model(run)
    assert cfg.data.tokenizer == "hf" and cfg.model.moe.num_experts == 4
    x = tokens(seed=9)
    with torch.no_grad():
        assert_close(model(x).logits, hf(x).logits, REFERENCE[torch.float32], "upcycled run")


@pytest.mark.parametrize("case,args,message", [
    ("moe_checkpoint", ["--experts", "4", "--top-k", "2"], "config.json model_type='qwen3_moe'"),
    ("granularity", ["--experts", "4", "--top-k", "2", "--granularity", "5"], "--granularity 5: does not divide"),
    ("copies", ["--experts", "3", "--top-k", "2", "--granularity", "2"], "--experts 3: must be a multiple"),
    ("top_k", ["--experts", "2", "--top-k", "3"], "--top-k 3: exceeds --experts 2"),
    ("missing_shard", ["--experts", "2", "--top-k", "1"], "names shards that are missing"),
    ("out_not_empty", ["--experts", "2", "--top-k", "1"], "--out='RUN': exists and is not an empty folder"),
])
def test_upcycle_bad_input_exits_2_and_writes_nothing(tmp_path: Path, case: str, args: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from hf_models import qwen3_config

    src = tmp_path / "src"
    save_hf(qwen3_config() if case == "moe_checkpoint" else qwen3_dense(), src)
    if case == "missing_shard":
        index = json.loads((src / import_hf.INDEX_FILE).read_text())
        (src / sorted(set(index["weight_map"].values()))[1]).unlink()
    out = tmp_path / "run"
    if case == "out_not_empty":
        out.mkdir()
        (out / "keep").write_text("x")
    capsys.readouterr()  # (save_pretrained's progress bar)
    assert cli(["upcycle", str(src), *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless upcycle: error:") and message.replace("RUN", str(out)) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["run", "src"] if case == "out_not_empty" else ["src"])
    if case == "out_not_empty":
        assert [p.name for p in out.iterdir()] == ["keep"]
