"""`dropless quantize` takes every expert width from the built modules (serve/packed.py), not from
re-derived config fields:
- LatentMoE (`model.moe.latent_dim` l < d): the experts read l-wide rows, so their packed codes are
  [E, l/2, 2F]; a skeleton sized by d_model could never load them. d=64, l=32 is the smallest shape
  whose latent width is a whole mxfp4 block (nvfp4's block is 16).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dropless import cli
from dropless.model import MoEModel
from dropless.serve import packed
from dropless.serve.evaluate import val_loss
from dropless.serve.load import load_model
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
        assert (layer.experts.num_experts, layer.experts.d_model, layer.experts.d_expert) == (E, D, F) == (4, 32, 32)
