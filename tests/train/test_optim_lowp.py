"""AdamWBF16 against torch.optim.AdamW: same formula, moments stored in bf16."""

from __future__ import annotations

import pytest
import torch

from dropless.train.optim_lowp import AdamWBF16, round_to_bf16, state_bytes
from tolerances import ADAMW_BF16_REL_DISPLACEMENT

HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _problem(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A small regression: a 2-layer MLP, 64 samples (the loss landscape is curved, grads change)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)


def _train(make_opt, steps: int) -> tuple[list[torch.Tensor], list[float], torch.optim.Optimizer]:
    model, x, y = _problem()
    opt = make_opt(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses, opt


def test_first_step_equals_torch() -> None:
    # From zero moments the first update uses fp32 m, v computed exactly as torch does: bit-identical.
    p_ref, _, _ = _train(lambda ps: torch.optim.AdamW(ps, **HYPER), steps=1)
    p_lp, _, _ = _train(lambda ps: AdamWBF16(ps, **HYPER), steps=1)
    for a, b in zip(p_lp, p_ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_tracks_torch_adamw_over_50_steps(rounding: str) -> None:
    p_ref, loss_ref, opt_ref = _train(lambda ps: torch.optim.AdamW(ps, **HYPER), steps=50)
    gen = torch.Generator().manual_seed(0)
    p_lp, loss_lp, opt_lp = _train(lambda ps: AdamWBF16(ps, **HYPER, rounding=rounding, generator=gen), 50)
    p0 = [p.detach() for p in _problem()[0].parameters()]
    err = sum(float((a - b).pow(2).sum()) for a, b in zip(p_lp, p_ref)) ** 0.5
    moved = sum(float((b - c).pow(2).sum()) for b, c in zip(p_ref, p0)) ** 0.5
    assert err < ADAMW_BF16_REL_DISPLACEMENT * moved, (err, moved)
    assert loss_lp[-1] < 0.9 * loss_lp[0]  # it trains
    assert abs(loss_lp[-1] - loss_ref[-1]) < 1e-2 * loss_ref[-1]
    for state in opt_lp.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


def test_state_is_half_of_torch_adamw() -> None:
    _, _, opt_ref = _train(lambda ps: torch.optim.AdamW(ps, **HYPER), steps=1)
    _, _, opt_lp = _train(lambda ps: AdamWBF16(ps, **HYPER), steps=1)
    params = list(_problem()[0].parameters())
    n = sum(p.numel() for p in params)
    # two bf16 moments per element; a float32 step count per parameter tensor, as torch keeps it
    assert state_bytes(opt_lp) == 4 * n + 4 * len(params)
    steps = 4 * len(params)  # both keep a 4-byte step tensor per parameter tensor
    assert state_bytes(opt_lp) - steps == (state_bytes(opt_ref) - steps) / 2  # torch: 8 bytes/element


def test_stochastic_rounding_is_unbiased() -> None:
    x = torch.full((200_000,), 1.0 + 2 ** -10)  # a quarter of the way from 1 to the next bf16 (1 + 2^-7)
    gen = torch.Generator().manual_seed(0)
    r = round_to_bf16(x, "stochastic", gen).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(r.mean().item() - x[0].item()) < 2e-5  # std of the mean: 2^-7 * sqrt(3/16) / sqrt(2e5)
    assert torch.equal(round_to_bf16(-x, "stochastic", torch.Generator().manual_seed(0)), -r.bfloat16())
    assert torch.equal(round_to_bf16(x, "nearest"), torch.ones(200_000, dtype=torch.bfloat16))


def test_second_moment_stalls_with_nearest_at_beta2_0999() -> None:
    # Why `rounding="stochastic"` exists: a constant gradient g = 1 drives fp32 exp_avg_sq to
    # 1 - 0.999^t (0.632 at t = 1000). In bf16 with round-to-nearest each increment 0.001 * (1 - v)
    # falls under half an ulp of v once v > ~1/3, so v stalls there; stochastic rounding keeps it unbiased.
    def run(rounding: str) -> float:
        p = torch.nn.Parameter(torch.zeros(512))
        opt = AdamWBF16([p], lr=0.0, weight_decay=0.0, rounding=rounding,
                        generator=torch.Generator().manual_seed(0))
        for _ in range(1000):
            p.grad = torch.ones_like(p)
            opt.step()
        return opt.state[p]["exp_avg_sq"].float().mean().item()

    exact = 1 - 0.999 ** 1000
    assert run("nearest") < 0.6 * exact
    assert abs(run("stochastic") - exact) < 0.01 * exact


def test_rejects_bad_arguments() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="rounding='up'"):
        AdamWBF16([p], rounding="up")
    with pytest.raises(ValueError, match="betas"):
        AdamWBF16([p], betas=(0.9, 1.0))
    q = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    q.grad = torch.ones_like(q)
    with pytest.raises(ValueError, match="fp32 master"):
        AdamWBF16([q]).step()


def test_moments_stay_bf16_across_a_state_dict_round_trip() -> None:
    # torch's load_state_dict casts floating state to the parameter dtype: the moments came back fp32
    # (twice the memory after every resume). They must come back bf16, and the next step be identical.
    model, x, y = _problem()
    twin = _problem()[0]
    opt, opt2 = AdamWBF16(model.parameters(), **HYPER), AdamWBF16(twin.parameters(), **HYPER)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    twin.load_state_dict(model.state_dict())
    opt2.load_state_dict(opt.state_dict())
    for state in opt2.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    for m, o in ((model, opt), (twin, opt2)):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
