"""Balancing rules: aux-loss scopes (sequence, global batch with accumulation), loss-free bias,
quantile balancing, and the config rules that refuse unsound combinations."""

from __future__ import annotations

import pytest
import torch

from dropless.config import BalanceConfig, MoEConfig, RouterConfig
from dropless.layers import balance
from dropless.ops import routing


def route(x_TD: torch.Tensor, w_ED: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, _, scores = routing.topk_route(x_TD @ w_ED.t(), top_k=k)
    return scores, ids


def test_sequence_aux_loss_is_the_mean_of_per_sequence_losses() -> None:
    g = torch.Generator().manual_seed(0)
    B, S, E, K = 3, 7, 5, 2
    probs = torch.softmax(torch.randn(B * S, E, generator=g), -1)
    ids = probs.topk(K, -1).indices
    per_seq = [routing.switch_aux_loss(probs[b * S:(b + 1) * S], routing.expert_counts(ids[b * S:(b + 1) * S], E), K)
               for b in range(B)]
    torch.testing.assert_close(balance.sequence_aux_loss(probs, ids, S), torch.stack(per_seq).mean())
    # one sequence: equals the micro-batch loss
    torch.testing.assert_close(balance.sequence_aux_loss(probs, ids, B * S),
                               routing.switch_aux_loss(probs, routing.expert_counts(ids, E), K))
    with pytest.raises(ValueError, match="seq_len=4"):
        balance.sequence_aux_loss(probs, ids, 4)


@pytest.mark.parametrize("sizes", [(8, 8, 8), (5, 11, 3)])  # equal, and unequal micro-batches
def test_global_aux_loss_with_accumulation_equals_concatenated_batch(sizes: tuple[int, ...]) -> None:
    # float64 so the comparison checks the algebra, not rounding (tolerance: a few ulps of fp64).
    g = torch.Generator().manual_seed(1)
    E, K, D = 6, 2, 5
    w = torch.randn(E, D, generator=g, dtype=torch.float64, requires_grad=True)
    xs = [torch.randn(T, D, generator=g, dtype=torch.float64) for T in sizes]
    # the concatenated global batch
    scores, ids = route(torch.cat(xs), w, K)
    ref = routing.switch_aux_loss(scores, routing.expert_counts(ids, E), K)
    (gref,) = torch.autograd.grad(ref, w)
    # counts from every micro-batch first (a no-grad routing pre-pass), then accumulation
    with torch.no_grad():
        counts = sum(routing.expert_counts(route(x, w, K)[1], E) for x in xs)
    n = len(xs)
    total = torch.zeros((), dtype=torch.float64)
    for x in xs:
        scores_m, _ = route(x, w, K)
        loss_m = balance.global_aux_loss(scores_m.mean(0), counts, K, num_tokens=x.shape[0], num_terms=n)
        (loss_m / n).backward()  # what gradient accumulation does
        total = total + loss_m.detach() / n
    torch.testing.assert_close(total, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, gref, rtol=1e-12, atol=1e-12)


def test_bias_update_moves_against_the_load() -> None:
    bias = torch.zeros(4)
    new = balance.bias_update(bias, torch.tensor([10, 2, 4, 4]), rate=1e-3)  # mean 5
    assert new.tolist() == pytest.approx([-1e-3, 1e-3, 1e-3, 1e-3])
    assert balance.bias_update(bias, torch.tensor([3, 3, 3, 3]), 0.1).tolist() == [0.0] * 4


def bias_update_reference(bias: list[float], counts: list[int], rate: float, rule: str) -> list[float]:
    """The rules written out per expert in plain Python (floats, no tensors)."""
    mean = sum(counts) / len(counts)
    out = []
    for b, c in zip(bias, counts):
        if rule == "sign":
            out.append(b + rate * ((mean > c) - (mean < c)))
        else:  # proportional: the relative violation, no move when nothing was routed
            out.append(b + (rate * (mean - c) / mean if mean > 0 else 0.0))
    return out


@pytest.mark.parametrize("rule", ["sign", "proportional"])
@pytest.mark.parametrize("counts", [
    [10, 2, 4, 4],  # mean 5: one hot, three cold
    [3, 3, 3, 3],  # balanced: nothing moves
    [0, 0, 0, 0],  # nothing routed (an empty micro-batch): nothing moves, no division by zero
    [16, 0, 0, 0, 0, 0, 0, 0],  # every token on one expert (k = 2 of 8 caps it at 4x, here 8x)
    [7, 1, 0, 9, 3],  # prime E, an empty expert
])
def test_bias_update_rules_match_the_reference(rule: str, counts: list[int]) -> None:
    g = torch.Generator().manual_seed(len(counts))
    bias = torch.randn(len(counts), generator=g) * 0.01
    new = balance.bias_update(bias, torch.tensor(counts), 3e-3, rule)
    ref = bias_update_reference(bias.tolist(), counts, 3e-3, rule)
    torch.testing.assert_close(new, torch.tensor(ref), rtol=1e-6, atol=1e-9)  # fp32 vs Python floats
    with pytest.raises(ValueError, match="bias_update_rule='nope'"):
        balance.bias_update(bias, torch.tensor(counts), 1e-3, "nope")


def test_proportional_step_scales_with_the_violation() -> None:
    # the sign rule moves every unbalanced expert by u; the proportional rule by u * violation
    counts = torch.tensor([40, 10, 10, 20])  # mean 20: violations +1, -0.5, -0.5, 0
    new = balance.bias_update(torch.zeros(4), counts, 0.01, "proportional")
    assert new.tolist() == pytest.approx([-0.01, 0.005, 0.005, 0.0])


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_quantile_step_is_the_ema_of_the_quantile_bias(momentum: float) -> None:
    g = torch.Generator().manual_seed(2)
    bias, target = torch.randn(6, generator=g), torch.randn(6, generator=g)
    new = balance.quantile_step(bias, target, momentum)
    ref = [momentum * b + (1 - momentum) * q for b, q in zip(bias.tolist(), target.tolist())]
    torch.testing.assert_close(new, torch.tensor(ref), rtol=1e-6, atol=1e-7)
    if momentum == 0.0:  # the old rule bit for bit: the bias set to q outright
        assert torch.equal(new, target)


def skewed_scores(T: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    skew = torch.linspace(0.0, 3.0, E)  # expert E-1 is strongly preferred
    return torch.softmax(torch.randn(T, E, generator=g) + skew, -1)


def test_quantile_bias_brings_loads_close_to_uniform() -> None:
    T, E, K = 2048, 16, 2
    scores = skewed_scores(T, E, 0)
    one_pass = balance.quantile_bias(scores, K, iters=1)
    bias = balance.quantile_bias(scores, K)
    assert abs(float(bias.mean())) < 1e-6  # the free constant is fixed to a zero mean

    def vio(s: torch.Tensor, b: torch.Tensor | None) -> float:
        sel = s if b is None else s + b
        return float(balance.maxvio(routing.expert_counts(sel.topk(K, -1).indices, E)))

    before = vio(scores, None)
    assert before > 2.0, before  # the busiest expert takes about 4x its share
    # the pure threshold approximation: much closer to uniform, not at it
    assert vio(scores, one_pass) < 0.3 * before
    # refined: near uniform on the batch it was fitted on, and close on a fresh batch from the same
    # distribution (sampling noise of ~256 tokens per expert is ~6%, plus the fit's own error)
    assert vio(scores, bias) < 0.1
    assert vio(skewed_scores(T, E, 1), bias) < 0.25
    assert torch.equal(balance.quantile_bias(scores[:, :2], 2), torch.zeros(2))  # k = E


def test_maxvio() -> None:
    assert float(balance.maxvio(torch.tensor([2, 2, 2, 2]))) == 0.0
    assert float(balance.maxvio(torch.tensor([8, 0, 0, 0]))) == 3.0
    assert float(balance.maxvio(torch.tensor([0, 0]))) == 0.0


@pytest.mark.parametrize("kw,match", [
    (dict(router=RouterConfig(strategy="expert_choice", use_expert_bias=True)), "use_expert_bias"),
    (dict(router=RouterConfig(strategy="nope")), "strategy='nope'"),
    (dict(balance=BalanceConfig(quantile_balance=True)), "quantile_balance"),
    (dict(router=RouterConfig(use_expert_bias=True),
          balance=BalanceConfig(quantile_balance=True, bias_update_rate=1e-3)), "choose one"),
    (dict(router=RouterConfig(use_expert_bias=True), balance=BalanceConfig(bias_update_rate=0.2)),
     "bias_update_rate=0.2"),
    (dict(balance=BalanceConfig(seq_aux_loss_coeff=-1.0)), "seq_aux_loss_coeff=-1.0"),
    (dict(router=RouterConfig(use_expert_bias=True),
          balance=BalanceConfig(bias_update_rate=1e-3, bias_update_rule="pid")), "bias_update_rule='pid'"),
    (dict(router=RouterConfig(use_expert_bias=True),
          balance=BalanceConfig(quantile_balance=True, quantile_momentum=1.0)), "quantile_momentum=1.0"),
    (dict(router=RouterConfig(use_expert_bias=True),
          balance=BalanceConfig(quantile_balance=True, quantile_momentum=-0.1)), "quantile_momentum=-0.1"),
    (dict(router=RouterConfig(use_expert_bias=True),
          balance=BalanceConfig(bias_update_rate=1e-3, quantile_momentum=0.9)), "needs quantile_balance"),
    (dict(router=RouterConfig(use_expert_bias=True), balance=BalanceConfig(bias_warm_start_steps=5)),
     "bias_warm_start_steps=5"),
    (dict(router=RouterConfig(use_expert_bias=True),
          balance=BalanceConfig(bias_update_rate=1e-3, bias_warm_start_steps=-1)), "bias_warm_start_steps=-1"),
    (dict(router=RouterConfig(use_expert_bias=True),
          balance=BalanceConfig(bias_update_rate=1e-3, bias_rate_schedule="cosine")), "bias_rate_schedule='cosine'"),
    (dict(router=RouterConfig(use_expert_bias=True), balance=BalanceConfig(bias_rate_schedule="lr")),
     "bias_rate_schedule='lr'.*needs bias_update_rate > 0"),
    (dict(router=RouterConfig(strategy="expert_threshold", max_experts_per_token=9)), "max_experts"),
    (dict(router=RouterConfig(threshold_momentum=1.0)), "threshold_momentum"),
])
def test_config_refuses_unsound_balancing(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoEConfig(num_experts=8, top_k=2, d_expert=8, **kw)


def test_config_accepts_sound_balancing() -> None:
    # sign step below 1/E with softmax; post-softmax selects on logits, where the bound does not apply
    MoEConfig(num_experts=8, top_k=2, router=RouterConfig(use_expert_bias=True),
              balance=BalanceConfig(bias_update_rate=1e-3))
    MoEConfig(num_experts=8, top_k=2, router=RouterConfig(use_expert_bias=True, pre_softmax=False),
              balance=BalanceConfig(bias_update_rate=0.5))
    MoEConfig(num_experts=8, top_k=2, router=RouterConfig(use_expert_bias=True),
              balance=BalanceConfig(quantile_balance=True, seq_aux_loss_coeff=0.01,
                                        global_aux_loss_coeff=0.01))


def test_layer_sequence_scope_and_global_probabilities() -> None:
    from dropless.layers.moe import MoELayer
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=5, top_k=2, d_expert=8, balance=BalanceConfig(seq_aux_loss_coeff=0.1))
    layer = MoELayer(16, cfg)
    x = torch.randn(3, 7, 16)
    out = layer(x)
    d = layer.router(x.view(21, 16))
    torch.testing.assert_close(out.seq_aux_loss, balance.sequence_aux_loss(d.scores_TE, d.ids_TK, 7))
    torch.testing.assert_close(out.probs_mean_E, d.scores_TE.mean(0))
    assert out.probs_mean_E.requires_grad  # the global aux loss backpropagates through it


def test_first_balanced_step_takes_a_window_of_the_worst_layer() -> None:
    from dropless.bench.balance import first_balanced_step

    def rows(*vio_per_layer: list[float]) -> list[dict]:
        return [{"step": 10 + i, "layers": [{"maxvio_global": v[i]} for v in vio_per_layer]}
                for i in range(len(vio_per_layer[0]))]

    calm = [0.1] * 12
    # one lucky step does not count; a window of 3 reaching <= 0.5 does, at its last step
    assert first_balanced_step(rows([2.0, 0.0, 2.0, 0.6, 0.5, 0.4, 0.5]), window=3) == 15
    # the worst layer decides: layer 0 is calm, layer 1 is not
    assert first_balanced_step(rows(calm, [1.0] * 12), window=3) is None
    assert first_balanced_step(rows(calm, calm), window=10) == 19
    assert first_balanced_step(rows([0.1] * 5), window=10) is None  # fewer steps than the window


def adaptive_reference(counts_seq: list[list[int]], rate: float) -> list[list[float]]:
    """The adaptive rule written out per expert in plain Python: a step per expert that grows 1.2x
    while the sign of (mean - load) repeats, halves when it flips, stays when either sign is 0,
    clamped to [u/10, 50u]; returns the bias after each step."""
    E = len(counts_seq[0])
    bias, step, last, out = [0.0] * E, [rate] * E, [0.0] * E, []
    for counts in counts_seq:
        mean = sum(counts) / E
        for e, c in enumerate(counts):
            d = float((mean > c) - (mean < c))
            s = step[e] * (1.2 if d * last[e] > 0 else 0.5 if d * last[e] < 0 else 1.0)
            step[e] = min(max(s, rate / 10), 50 * rate)
            bias[e] += step[e] * d
            last[e] = d
        out.append(list(bias))
    return out


def test_adaptive_bias_update_matches_the_reference() -> None:
    # 30 steps of E = 7 (prime), mean load 10: expert 0 hot throughout (its step grows to the 50u
    # cap), expert 1 cold then hot (one halving at the flip), expert 2 at the mean (no move, step
    # kept), expert 3 flipping every step (its step decays to the u/10 floor), experts 4 and 5 empty
    seq = []
    for t in range(30):
        c1 = 3 if t < 10 else 14
        c3 = 15 if t % 2 else 5
        seq.append([18, c1, 10, c3, 0, 0, 42 - c1 - c3])
    rate = 1e-3
    bias, step, sign = torch.zeros(7), torch.full((7,), rate), torch.zeros(7)
    want = adaptive_reference(seq, rate)
    for t, counts in enumerate(seq):
        bias, step, sign = balance.adaptive_bias_update(bias, step, sign, torch.tensor(counts), rate)
        torch.testing.assert_close(bias, torch.tensor(want[t]), rtol=1e-5, atol=1e-7)  # fp32 vs floats
    assert step[0].item() == pytest.approx(50 * rate)  # the cap
    assert step[3].item() == pytest.approx(rate / 10)  # the floor
    assert step[2].item() == pytest.approx(rate) and bias[2].item() == 0.0  # at the mean: never moved
    assert bias[0].item() < -0.5 * 50 * rate * 10  # the hot expert ran far below the sign rule's -0.03
    nothing = balance.adaptive_bias_update(bias, step, sign, torch.zeros(7, dtype=torch.long), rate)
    assert torch.equal(nothing[0], bias) and torch.equal(nothing[1], step)  # nothing routed: no move


def test_bias_rate_scale_follows_the_lr_after_its_warm_up() -> None:
    """constant: always 1; lr: 1 through the warm-up (steps 0..w-1), then lr / base_lr."""
    assert balance.bias_rate_scale("constant", 500, 1e-3, 1e-2, 50) == 1.0
    assert balance.bias_rate_scale("lr", 49, 9.8e-3, 1e-2, 50) == 1.0
    assert balance.bias_rate_scale("lr", 50, 1e-2, 1e-2, 50) == 1.0
    assert balance.bias_rate_scale("lr", 599, 1e-3, 1e-2, 50) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="bias_rate_schedule='step'"):
        balance.bias_rate_scale("step", 100, 1e-3, 1e-2, 50)
