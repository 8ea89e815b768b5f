"""The generate stage's logits check runs low-precision experts in full precision (check/greedy.py)."""

from __future__ import annotations

import torch

from dropless.check.greedy import _full_precision_experts
from dropless.config import apply_overrides, load_config
from dropless.model import MoEModel
from dropless.runs import presets


def test_low_precision_experts_checked_in_full_precision_and_restored() -> None:
    cfg = apply_overrides(load_config(presets.preset_path("tiny")),
                          ["model.n_layers=2", "model.d_model=128", "model.moe.d_expert=128",
                           "model.moe.precision=fp8_blockwise"]).model
    model = MoEModel(cfg, seed=0).eval()
    x = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        quantised = model(x).logits
        with _full_precision_experts(model):
            assert {m.experts.precision for m in model.moe_layers()} == {"bf16"}
            full = model(x).logits
        assert {m.experts.precision for m in model.moe_layers()} == {"fp8_blockwise"}
        again = model(x).logits
    assert torch.equal(again, quantised) and not torch.equal(full, quantised)
