"""`dropless quantize` takes every expert width and count from the built modules (runs/packed.py,
expert_slots.py), not from re-derived config fields:
- LatentMoE (`model.moe.latent_dim` l < d): the experts read l-wide rows, so their packed codes are
  [E, l/2, 2F]; a skeleton sized by d_model could never load them. d=64, l=32 is the smallest shape
  whose latent width is a whole mxfp4 block (nvfp4's block is 16).
- identity experts (`model.moe.n_identity_experts`): chosen like experts (ids E .. E+Z-1) but with no
  weights, so `--report` counts the routed experts a decode step reads and leaves them out.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dropless import cli
from dropless.expert_slots import ExpertSlots
from dropless.model import MoEModel
from dropless.runs import packed
from dropless.serve.evaluate import val_loss
from dropless.runs.load import load_model
from dropless.serve.quantize import distinct_experts
from dropless.train.loop import Trainer
from test_quantize import _fake_quantised
from tiny_run import tiny
from tolerances import PACKED_VAL_LOSS, REFERENCE, assert_close

TWO_STEPS = ("train.steps=2", "train.ckpt_every=2", "train.eval_every=2")
LATENT = ("model.d_model=64", "model.moe.latent_dim=32")


@pytest.fixture(scope="module")
def latent_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("latent") / "run"
    Trainer(tiny(*LATENT, *TWO_STEPS), run).fit()
    return run


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_a_latent_run_quantizes_loads_and_evaluates(latent_run: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "q"
    assert cli.main(["quantize", str(latent_run), "--experts", fmt, "--out", str(out)]) == 0
    q, cfg = load_model(out)
    orig, _ = load_model(latent_run)
    for layer_q, layer in zip(q.moe_layers(), orig.moe_layers(), strict=True):
        assert packed.expert_shape(layer) == (4, 32, 32)  # E, l, F
        assert layer_q.experts.gate_up_codes.shape == (4, 32 // 2, 2 * 32)
    x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(q(x).logits, _fake_quantised(latent_run, fmt)(x).logits, REFERENCE[torch.float32],
                     f"latent {fmt} logits")
    loss_q, loss = val_loss(q, cfg, max_batches=2), val_loss(orig, cfg, max_batches=2)
    assert abs(loss_q / loss - 1) <= PACKED_VAL_LOSS, (loss_q, loss)


def test_the_skeleton_is_built_on_meta_with_the_built_widths() -> None:
    cfg = tiny(*LATENT).model
    skeleton = packed.packed_skeleton(cfg, "mxfp4")
    assert skeleton.head.weight is skeleton.embed.weight  # tied again after leaving the meta device
    assert not any(t.is_meta for t in [*skeleton.parameters(), *skeleton.buffers()])
    built = MoEModel(cfg)  # the rotary tables are computed, never stored: the skeleton computes them
    assert torch.equal(skeleton.rope_cos, built.rope_cos) and torch.equal(skeleton.rope_sin, built.rope_sin)
    ref = packed.meta_model(cfg)
    for layer, meta_layer in zip(skeleton.moe_layers(), ref.moe_layers(), strict=True):
        E, D, F = packed.expert_shape(meta_layer)
        packed_shape = (layer.experts.num_experts, layer.experts.d_model, layer.experts.d_expert)
        assert packed_shape == (E, D, F) == (4, 32, 32)


@pytest.fixture(scope="module")
def identity_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("identity") / "run"
    Trainer(tiny("model.moe.n_identity_experts=2", *TWO_STEPS), run).fit()
    return run


def test_report_on_identity_experts_counts_the_routed_experts_read(identity_run: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    report = tmp_path / "r.json"
    assert cli.main(["quantize", str(identity_run), "--report", "--max-batches", "1",
                     "--json", str(report)]) == 0
    assert "E=4 (+2 identity)" in capsys.readouterr().out
    r = json.loads(report.read_text())
    assert (r["num_experts"], r["identity_experts"], r["top_k"]) == (4, 2, 2)
    for B, per_layer in r["distinct_experts_per_layer"].items():
        assert all(0 < v <= min(4, 2 * int(B)) for v in per_layer), (B, per_layer)
    # uniform routing over the 6 selectable experts reads E * (1 - (1 - K/6)^B) of the 4 routed ones
    assert r["distinct_experts_uniform"]["1"] == pytest.approx(4 * 2 / 6)


def test_distinct_experts_leaves_the_identity_experts_out() -> None:
    # 4 sequences of 2 tokens, K=2 of E=4 routed + Z=2 identity. Position 0: every sequence picks
    # {0, 4} (one routed expert read). Position 1: sequence i picks {i, 5}. B=1: one routed expert per
    # token. B=4: position 0 reads 1, position 1 reads 4: 2.5.
    cfg = tiny("train.batch_size=4", "train.seq_len=2")
    ids = torch.zeros(4, 2, 2, dtype=torch.int64)
    ids[:, 0] = torch.tensor([0, 4])
    ids[:, 1, 0] = torch.arange(4)
    ids[:, 1, 1] = 5

    def model(x):
        return SimpleNamespace(moe=[SimpleNamespace(ids_TK=ids.view(8, 2), valid_TK=None)])

    model.expert_slots = lambda: ExpertSlots(4, 2)
    assert distinct_experts(model, cfg, _windows(cfg)) == {1: [1.0], 4: [2.5]}


def _windows(cfg):
    """1000 tokens 0..255, 0.. as one validation run (serve.evaluate.val_windows' shape of data)."""
    import numpy as np

    from dropless.data.windows import TokenRun, Windows

    return Windows([TokenRun(np.arange(1000) % 256, np.zeros(1, dtype=np.int64))], cfg.train.seq_len)
