"""Load-balancing rules as pure functions: aux losses by scope, loss-free bias, quantile balancing.

Legend: T tokens, B sequences, S tokens per sequence (T = B*S), E experts, K experts per token.
    probs_TE   router probabilities (routing.router_probs: rows sum to 1), carry the gradient
    counts_E   pairs routed to each expert (int64, no gradient: they come from a discrete choice)
    bias_E     selection-only expert bias

Aux-loss scopes (all without their coefficient; all read 1.0 at perfect balance with flat probs):
- micro-batch: `routing.switch_aux_loss`, f and P from the same micro-batch.
- sequence: the same per sequence, averaged over sequences. Stricter: every sequence must spread
  its tokens, which fights per-document specialisation.
- global batch: f from the whole optimizer step (all micro-batches, all data-parallel ranks), P from
  the current micro-batch. With the global f held fixed, the global loss
      L = E * sum_e f_e * P_e^global,   P_e^global = sum_m (T_m / T_glob) * P_e^m
  is linear in the micro-batch means P^m, so L = (1/n) * sum_m loss_m exactly when
      loss_m = n * (T_m / T_glob) * E * sum_e f_e * P_e^m,
  n being the number of loss terms the gradient averages (micro-batches times data-parallel ranks
  when the ranks' gradients are averaged). Value and gradient both match the concatenated batch.
  Causality: f needs every micro-batch's counts before the first backward. Options for the trainer:
  a no-grad routing pre-pass over the step's micro-batches (costs router GEMMs only), or the running
  counts of the micro-batches seen so far (Megatron's approximation: the loss is then not exact).

Loss-free bias (DeepSeek-V3): `bias_update`, once per optimizer step from global counts.

Quantile balancing: `quantile_bias` sets the bias from the score distribution. An expert e admits
token t under top-k when score_te + b_e is among t's k largest. The per-expert threshold
approximation replaces that coupled rule by independent ones: e admits t when score_te > q_e, with
q_e the (1 - k/E) quantile of e's scores, which gives every expert exactly T*k/E tokens. Setting
b_e = c - q_e makes "score_te + b_e > c" that rule; top-k then takes each token's k largest margins
score_te - q_e, which differs from the threshold rule only for tokens with more or fewer than k
positive margins, so loads land near, not at, T*k/E. The constant c cancels in every top-k (and in
group-limited selection), so c is chosen to make the bias mean zero. Pass the unbiased tensor the
router selects on (`Router.selection_base`: logits for post-softmax routing).
"""

from __future__ import annotations

import torch

from ..ops import routing


def sequence_aux_loss(probs_TE: torch.Tensor, ids_TK: torch.Tensor, seq_len: int,
                      valid_TK: torch.Tensor | None = None) -> torch.Tensor:
    """Switch aux loss per sequence of `seq_len` consecutive tokens, averaged over sequences."""
    T, E = probs_TE.shape
    K = ids_TK.shape[1]
    if T % seq_len:
        raise ValueError(f"seq_len={seq_len}: does not divide the {T} tokens")
    B = T // seq_len
    one_hot_TKE = torch.nn.functional.one_hot(ids_TK, E).to(probs_TE.dtype)
    if valid_TK is not None:
        one_hot_TKE = one_hot_TKE * valid_TK.unsqueeze(-1)
    f_BE = one_hot_TKE.view(B, seq_len * K, E).sum(1) / (seq_len * K)
    P_BE = probs_TE.view(B, seq_len, E).mean(1)
    return E * (f_BE.detach() * P_BE).sum(-1).mean()


def global_aux_loss(probs_mean_E: torch.Tensor, global_counts_E: torch.Tensor, top_k: int, *,
                    num_tokens: int, num_terms: int) -> torch.Tensor:
    """This micro-batch's term of the global-batch aux loss (see the module note).

    probs_mean_E: this micro-batch's mean router probability (MoEOutput.probs_mean_E, with grad);
    global_counts_E: counts summed over every micro-batch of the step and every data-parallel rank;
    num_tokens: this micro-batch's T_m; num_terms: n, the loss terms the gradient averages.
    The trainer backpropagates loss_m / n_micro like any other loss; summed, the terms equal the loss
    of the concatenated batch in value and gradient.
    """
    counts = global_counts_E.to(probs_mean_E.dtype)
    E = probs_mean_E.shape[0]
    total_pairs = counts.sum()
    f_E = counts / total_pairs.clamp_min(1.0)
    tokens_glob = total_pairs / top_k
    scale = num_terms * num_tokens / tokens_glob.clamp_min(1.0)
    return scale * E * (f_E * probs_mean_E).sum()


def bias_update(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float, rule: str = "sign") -> torch.Tensor:
    """Loss-free balancing step; returns the new bias. Use global-batch counts, once per optimizer step.

    sign:         b_e += u * sign(mean_load - load_e)   (DeepSeek-V3; experts at the mean do not move)
    proportional: b_e += u * (mean_load - load_e) / mean_load
    The proportional step is the expert's relative violation times u: large while the router is far
    from balance (an expert at 3x its share moves 2u), small near it. The sign rule's fixed step must
    be small to settle and then takes hundreds of steps to catch up. The proportional step lies in
    [-u * (E/k - 1), u] (an expert takes each token at most once). Nothing routed: no move. On the
    tiny preset (softmax, byte tokens) u = 0.02 oscillated: a large step moves whole clumps of
    near-margin tokens at once (docs/balancing.md "Measured on the 16-expert default").
    """
    load = counts_E.to(bias_E.dtype)
    mean = load.mean()
    if rule == "sign":
        return bias_E + rate * torch.sign(mean - load)
    if rule == "proportional":
        return bias_E + rate * (mean - load) / mean.clamp_min(1.0)
    raise ValueError(f"bias_update_rule={rule!r}: expected 'sign' or 'proportional' (adaptive keeps "
                     "state: adaptive_bias_update)")


def bias_rate_scale(schedule: str, step: int, lr: float, base_lr: float, warmup_steps: int) -> float:
    """The factor on the bias step u at optimizer step `step` (balance.bias_rate_schedule).
    constant: 1. lr: 1 during the lr's warm-up (the router moves fastest then, and the bias must keep
    up), then lr / base_lr, so the bias step decays with the lr's schedule (cosine to min_lr_ratio)."""
    if schedule not in ("constant", "lr"):
        raise ValueError(f"bias_rate_schedule={schedule!r}: expected 'constant' or 'lr'")
    if schedule == "constant" or step < warmup_steps or base_lr <= 0:
        return 1.0
    return lr / base_lr


# The adaptive rule's constants (Rprop's: Riedmiller & Braun 1993). The step grows 1.2x per step while
# an expert stays on one side of the mean, so a 1e-3 step reaches 0.04 within 20 steps of a steady
# drift (the tiny preset's softmax router needed |b| of 0.2-0.6 within its first hundred steps); it
# halves when the violation changes sign, so a step that overshot shrinks at once instead of
# oscillating (proportional u = 0.02 did). Bounds: at least u/10 (the router keeps moving, and noise
# alone flips an expert near balance every other step: a floor keeps it tracking), at most 50u.
ADAPTIVE_UP, ADAPTIVE_DOWN, ADAPTIVE_MIN, ADAPTIVE_MAX = 1.2, 0.5, 0.1, 50.0


def adaptive_bias_update(bias_E: torch.Tensor, step_E: torch.Tensor, last_E: torch.Tensor,
                         counts_E: torch.Tensor, rate: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sign rule with a per-expert step size (bias_update_rule = "adaptive"); returns (bias,
    step, sign). d_e = sign(mean - load_e); the step s_e is multiplied by ADAPTIVE_UP where d_e has
    the sign of the last step's d_e, by ADAPTIVE_DOWN where it has the other sign, kept where either
    is 0 (an expert at the mean, or the first step), then clamped to [ADAPTIVE_MIN * u, ADAPTIVE_MAX
    * u]; b_e += s_e * d_e. Nothing routed: no move, and the step is kept."""
    load = counts_E.to(bias_E.dtype)
    d = torch.sign(load.mean() - load)
    same = d * last_E
    step = torch.where(same > 0, step_E * ADAPTIVE_UP, torch.where(same < 0, step_E * ADAPTIVE_DOWN, step_E))
    step = step.clamp(ADAPTIVE_MIN * rate, ADAPTIVE_MAX * rate)
    return bias_E + step * d, step, d


def quantile_step(bias_E: torch.Tensor, target_E: torch.Tensor, momentum: float) -> torch.Tensor:
    """Quantile balancing's bias move: b <- m * b + (1 - m) * q, q = the step's `quantile_bias`.
    m = 0 sets the bias to q outright (every token's routing follows this step's noisy estimate)."""
    if momentum == 0.0:
        return target_E.to(bias_E.dtype)
    return momentum * bias_E + (1.0 - momentum) * target_E.to(bias_E.dtype)


def quantile_bias(sel_TE: torch.Tensor, top_k: int, iters: int = 3) -> torch.Tensor:
    """Bias that makes each expert admit about its target share k/E of the tokens of `sel_TE`.

    First pass: b_e = c - q_e with q_e = routing.score_quantile (the (1 - k/E) quantile of expert
    e's unbiased selection scores) and c = mean_e q_e (zero-mean; c cancels in top-k): the
    per-expert threshold approximation of the module note. Each further pass undoes most of its
    error: with the current bias, token t's cutoff c_t is midway between its k-th and (k+1)-th
    biased selection values (t takes e iff sel_te + b_e > c_t); holding the cutoffs fixed, b_e is set
    to admit exactly a k/E share: b_e = -quantile_{1-k/E}(sel_te - c_t). On 2048 skewed softmax
    tokens, E=16, k=2 (tests/test_balance.py) MaxVio goes 2.9 -> 0.52 after the first pass and
    -> 0.03 after three. Group-limited masking is not modelled. k = E needs no bias (zeros).
    """
    T, E = sel_TE.shape
    if top_k >= E or T == 0:
        return sel_TE.new_zeros(E)
    s_TE = sel_TE.detach().float()
    q_E = routing.score_quantile(s_TE, top_k)
    bias_E = q_E.mean() - q_E
    for _ in range(iters - 1):
        top_TK1 = (s_TE + bias_E).topk(top_k + 1, dim=-1).values
        cut_T = 0.5 * (top_TK1[:, top_k - 1] + top_TK1[:, top_k])
        q_E = routing.score_quantile(s_TE - cut_T[:, None], top_k)
        bias_E = q_E.mean() - q_E
    return bias_E


def maxvio(counts_E: torch.Tensor) -> torch.Tensor:
    """max_e load / mean_e load - 1, on the device (0 = perfect balance, 0 when nothing routed)."""
    load = counts_E.float()
    mean = load.mean()
    return torch.where(mean > 0, load.max() / mean.clamp_min(1e-20) - 1.0, torch.zeros_like(mean))
