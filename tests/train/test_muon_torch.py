"""dropless's Muon (train/muon.py) against torch.optim.Muon on the case both cover: plain 2-D weights, no
blocks, bf16 Newton-Schulz. The maths is the same (the module note says where the two differ and why
dropless does not call torch's); the bf16 roundings are placed differently, hence a relative tolerance
(tests/tolerances.py MUON_VS_TORCH_BF16)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim._muon import (DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS,
                               _zeropower_via_newtonschulz)

from dropless.train.muon import NS_COEFFS, NS_EPS, NS_STEPS, Muon, Split, newton_schulz

from tolerances import MUON_VS_TORCH_BF16

# tall (both iterate on the transpose), wide, square, odd. Not tiny ones (5 x 7): with five singular
# values the rounding difference is as large as a 1% change of a coefficient (tolerances.py)
SHAPES = [(64, 32), (32, 96), (48, 48), (17, 40)]


def _randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def _torch_ns(g: torch.Tensor) -> torch.Tensor:
    # torch's own constants, not dropless's: a changed coefficient in either shows up
    return _zeropower_via_newtonschulz(g, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS).float()


def test_iteration_constants_are_torchs() -> None:
    assert NS_COEFFS == (DEFAULT_A, DEFAULT_B, DEFAULT_C) and NS_STEPS == DEFAULT_NS_STEPS and NS_EPS == EPS


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_bf16_newton_schulz_matches_torchs(shape: tuple[int, int]) -> None:
    # a batch of three experts, each against torch's 2-D iteration on its slice alone
    for seed in range(4):
        g_BRC = _randn((3, *shape), seed) * torch.tensor([1.0, 1e3, 1e-3]).view(3, 1, 1)
        o_BRC = newton_schulz(g_BRC, dtype=torch.bfloat16)
        for e in range(3):
            err = _rel(o_BRC[e], _torch_ns(g_BRC[e]))
            assert err <= MUON_VS_TORCH_BF16, f"seed {seed} expert {e}: relative error {err:.4f}"


@pytest.mark.parametrize("rule", ["match_rms_adamw", "original"])
def test_steps_match_torch_optim_muon(rule: str) -> None:
    # the same fp32 weights and gradient sequence through both optimizers; momentum 0.9, not the 0.95
    # default, so that a dropped argument shows
    lr, wd, mu, steps = 0.02, 0.1, 0.9, 4
    w0 = [0.05 * _randn(s, i) for i, s in enumerate(SHAPES)]
    ours = [nn.Parameter(w.clone()) for w in w0]
    theirs = [nn.Parameter(w.clone()) for w in w0]
    opt = Muon([{"params": ours, "muon": True}], {p: Split() for p in ours}, lr=lr, momentum=mu,
               weight_decay=wd, rms_match=0.2 if rule == "match_rms_adamw" else None, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(theirs, lr=lr, weight_decay=wd, momentum=mu, nesterov=True, adjust_lr_fn=rule)
    for step in range(steps):
        for i, (p, q) in enumerate(zip(ours, theirs)):
            p.grad = _randn(p.shape, 100 * step + i)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for w, p, q in zip(w0, ours, theirs):
        # the momentum is the same lerp on the same gradients in both
        assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
        err = _rel(p.detach() - w, q.detach() - w)
        assert err <= MUON_VS_TORCH_BF16, f"{tuple(w.shape)}: displacement off by {err:.4f} (relative)"
