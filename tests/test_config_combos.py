"""Config combinations that can only fail at model build or at the first forward are refused when the
config is validated, with a ValueError naming the fields.

Found by building the model from each candidate config and running one forward and backward (and one
trainer step): each refused combination below is shown to fail for real when validation is bypassed
(fields set after construction), so the config refuses nothing that works; neighbouring combinations
that do work stay accepted.
"""

from __future__ import annotations

import typing

import pytest
import torch

from dropless.config import PRECISION_WIDTH_BLOCK, PRECISIONS, load_config, parse_value
from dropless.model import MoEModel
from dropless.ops import quant_gemm

SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=16",
         "model.d_ff_dense=64", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.d_expert=64",
         "train.seq_len=16", "train.warmup_steps=1", "train.steps=2"]

# name -> (overrides, the fields the message must name)
REFUSED = {
    "mxfp8, d_model not a multiple of 32": (["model.moe.precision=mxfp8", "model.d_model=48"],
                                            ["model.d_model=48", "model.moe.precision='mxfp8'"]),
    "mxfp4, d_expert not a multiple of 32": (["model.moe.precision=mxfp4", "model.moe.d_expert=48"],
                                             ["model.moe.d_expert=48", "model.moe.precision='mxfp4'"]),
    "fp8_blockwise, widths below 128": (["model.moe.precision=fp8_blockwise"],
                                        ["model.d_model=64", "model.moe.precision='fp8_blockwise'"]),
    "nvfp4, d_expert not a multiple of 16": (["model.moe.precision=nvfp4", "model.moe.d_expert=40"],
                                             ["model.moe.d_expert=40", "precision='nvfp4'"]),
    "expert_choice with a capacity factor": (
        ["model.moe.router.strategy=expert_choice", "model.moe.capacity_factor=1.25"],
        ["model.moe.capacity_factor=1.25", "router.strategy='expert_choice'"]),
    "expert_threshold with a capacity factor": (
        ["model.moe.router.strategy=expert_threshold", "model.moe.capacity_factor=1.25"],
        ["model.moe.capacity_factor=1.25", "router.strategy='expert_threshold'"]),
    "negative init_std": (["model.init_std=-0.02"], ["model.init_std=-0.02"]),
    "negative norm_eps": (["model.norm_eps=-1e-6"], ["model.norm_eps=-1e-06"]),
    "vocab below the byte tokenizer's": (["model.vocab_size=100"], ["model.vocab_size=100", "data.tokenizer='byte'"]),
}

ACCEPTED = {
    "nvfp4 blocks of 16 take d_model 48": ["model.moe.precision=nvfp4", "model.d_model=48"],
    "a dense-only model ignores the MoE precision": ["model.moe.precision=mxfp8", "model.d_model=48",
                                                     "model.n_dense_layers=2"],
    "hash routing is token choice: capacity works": ["model.moe.router.strategy=hash",
                                                     "model.moe.capacity_factor=1.25"],
    "expert_choice without capacity": ["model.moe.router.strategy=expert_choice"],
    "low precision with the capacity layout": ["model.moe.precision=mxfp8", "model.moe.capacity_factor=1.0"],
}


def forward_backward(cfg) -> None:
    torch.manual_seed(0)
    model = MoEModel(cfg.model)
    x = torch.randint(0, 256, (2, cfg.train.seq_len))
    model(x, x).loss.backward()


def bypass(overrides: list[str]):
    """The config with `overrides` set after validation (each dataclass validates on construction)."""
    cfg = load_config(None, SMALL)
    for item in overrides:
        dotted, text = item.split("=", 1)
        *path, name = dotted.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        hints = typing.get_type_hints(type(obj))
        setattr(obj, name, parse_value(dotted, text, hints[name]))
    return cfg


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_when_validated(case: str) -> None:
    overrides, named = REFUSED[case]
    with pytest.raises(ValueError) as err:
        load_config(None, SMALL + overrides)
    for text in named:
        assert text in str(err.value), (text, str(err.value))


@pytest.mark.parametrize("case", sorted(c for c in REFUSED if "byte tokenizer" not in c and "norm_eps" not in c))
def test_refused_combinations_fail_for_real(case: str) -> None:
    """Without validation, each refused model config fails at model build or at the first forward.
    (The byte-tokenizer and norm_eps cases fail differently: tests below.)"""
    cfg = bypass(REFUSED[case][0])
    try:
        forward_backward(cfg)
    except (ValueError, RuntimeError):
        return
    pytest.fail(f"{case}: built and ran without validation: the refusal is not needed")


def test_vocab_below_the_tokenizer_fails_for_real() -> None:
    cfg = bypass(["model.vocab_size=100"])
    model = MoEModel(cfg.model)
    with pytest.raises(IndexError):
        model(torch.tensor([[200, 201]]))  # a byte above 99 has no embedding row


def test_negative_norm_eps_gives_nan() -> None:
    # RMS normalisation takes sqrt(mean(x^2) + eps): a negative eps is NaN wherever the activations are
    # small, here from the first forward on
    cfg = bypass(["model.norm_eps=-1.0"])
    torch.manual_seed(0)
    assert torch.isnan(MoEModel(cfg.model)(torch.zeros(1, 4, dtype=torch.long)).logits).any()


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_neighbours_still_accepted(case: str) -> None:
    forward_backward(load_config(None, SMALL + ACCEPTED[case]))


@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p != quant_gemm.FULL_PRECISION])
def test_width_blocks_match_the_gemm(precision: str) -> None:
    block = PRECISION_WIDTH_BLOCK[precision]
    quant_gemm.check_widths(precision, block, 3 * block)
    with pytest.raises(ValueError):
        quant_gemm.check_widths(precision, block // 2, block)
    with pytest.raises(ValueError):
        quant_gemm.check_widths(precision, block, block + block // 2)
