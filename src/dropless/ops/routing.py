"""Routing as pure functions: scores, (group-limited) top-k, combine weights, router losses.

Legend: T tokens, E experts, K experts per token (top_k), G expert groups, N = max(K, norm_top_k).
    logits_TE  router logits (fp32)
    scores_TE  score function of the logits (softmax / sigmoid / sqrt(softplus))
    bias_E     selection-only expert bias (loss-free balancing); never enters the weights
    ids_TK     chosen experts per token, int64
    weights_TK combine weights, fp32
    valid_TK   bool mask of real pairs, for strategies with a variable number of experts per token
               (expert choice, expert threshold): K is then a static bound (E, or a cap) and the
               invalid slots carry weight 0 and are skipped by the routing plan (ops/permute.py).
    q_E        per-expert score quantile at the target admission rate top_k / E

Numerics: everything here runs in fp32. A bf16 router flips expert choices on near-ties (bf16 keeps
8 mantissa bits, so logits 1e-2 apart at magnitude 4 are equal) and such flips were seen to make
training diverge; the caller casts the input to fp32 before the router GEMM.

The router GEMM keeps its input in the input's dtype (`router_logits`): autograd's fp32 linear on
`x.float()` would keep the fp32 copy for the weight gradient, a [T, D] fp32 tensor (4 KB per token
at d=1024) beside the bf16 input the caller keeps anyway; the Function re-casts the saved input in
the backward and runs the same products, so logits and gradients are the same bits.

Selection is done on `scores + bias` (or `logits + bias` for post-softmax); the weights are always
gathered from the unbiased scores, so the bias steers load without changing what the experts' outputs
are multiplied by.

Renormalised softmax weights are the softmax of the chosen logits: p_i / sum_{j in K} p_j with
p = softmax over all E is exp(l_i) / sum_{j in K} exp(l_j) (the full softmax's normaliser cancels),
so pre-softmax with renormalisation and post-softmax give the same weights, and both are computed as
`softmax(logits.gather(ids))`: one small softmax where the gather of the scores, their sum, the + eps
and the division were four ops, and whose backward is one [T, K] softmax backward where the
division's was seven ops plus the full [T, E] softmax backward. The rounding differs from the
quotient's by a few fp32 ulps, and the logits outside the chosen K get an exact zero gradient (the
quotient's was zero in exact arithmetic only). Selection is unchanged (it reads the full scores).
One case reads differently: imposed ids (replay, hash, forced) whose probabilities all underflow to
0 in fp32 (logits ~100 below the token's best) get weights that sum to 1, where the quotient gave 0.

Fewer experts at serving time (`norm_top_k`, docs/serving.md): a model trained with top-k can run
only its top K1 < k experts. Renormalising the K1 weights to sum to 1 inflates each kept expert's
weight beyond what training gave it; the seeds' rule instead routes the top K2 >= K1 exactly as the
model would (same selection: bias, groups; same weight rule: pre/post-softmax, renormalise, scaling
factor) and keeps the first K1 slots, so each kept weight is its score over the mass of the top K2:
    pre-softmax, renormalize: w_i = s * p_i / sum_{j in top K2} p_j   (p = the scores)
    post-softmax:             w_i = s * exp(l_i) / sum_{j in top K2} exp(l_j), the same quantity
                              with p = softmax over all E (the full softmax's normaliser cancels)
With K2 = the trained k each kept expert gets exactly its trained weight; a larger K2 shrinks them
all by one factor per token. With renormalize=False (and no post-softmax) the weights are the raw
scores and there is no mass to divide by, so K2 does nothing (RouterConfig refuses it).
A given `norm_top_k` always normalises, also over one expert (weight = scaling factor: the "kept"
rule at K1 = 1), whereas plain top-1 routing keeps the raw score p as its weight: renormalising one
weight gives the constant 1 and no router gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .permute import bin_counts

# Renormalising sigmoid or sqrt_softplus weights (softmax ones are a softmax of the chosen logits,
# module note) divides by their sum + _EPS, not by sum.clamp_min(_EPS): the same bits for
# any sum of at least 2^-42 = 2.3e-13 (1e-20 is below half an fp32 ulp there), and the backward of
# an add is free where clamp_min's is three ops (ge, where, a scalar) per layer call. Either keeps an
# all-zero row finite.
_EPS = 1e-20


def router_logits_reference(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """fp32 logits x_TD @ w_ED^T, autograd keeping the fp32 copy of x."""
    return torch.nn.functional.linear(x_TD.float(), w_ED)


class _RouterLinear(torch.autograd.Function):
    # The backward runs the products autograd's mm backward runs for the reference (grad @ w for the
    # input, then the cast back to its dtype; grad^T @ x for the weight, the column-major branch of
    # mm_mat2_backward, as w^T is column-major), so the gradients are the same bits.
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TD, w_ED)
        return torch.nn.functional.linear(x_TD.float(), w_ED)

    @staticmethod
    def backward(ctx, g_TE: torch.Tensor):
        x_TD, w_ED = ctx.saved_tensors
        gx = g_TE.mm(w_ED).to(x_TD.dtype) if ctx.needs_input_grad[0] else None
        gw = g_TE.t().mm(x_TD.float()) if ctx.needs_input_grad[1] else None
        return gx, gw


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """fp32 router logits of 2-d `x_TD` (any float dtype) and fp32 `w_ED`, keeping x_TD as given."""
    return _RouterLinear.apply(x_TD, w_ED)


def score_fn(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    if score_func == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    if score_func == "sigmoid":
        return torch.sigmoid(logits_TE)
    if score_func == "sqrt_softplus":
        return torch.sqrt(F.softplus(logits_TE))
    raise ValueError(f"score_func={score_func!r}: must be one of softmax, sigmoid, sqrt_softplus")


def group_limited_mask(sel_TE: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """Mask out experts outside the best `topk_groups` groups (DeepSeek-V3).

    Each group is scored by the sum of its two best selection scores (one when a group holds a single
    expert). Returns `sel_TE` with ineligible experts set to -inf.
    """
    if n_groups == 1 or topk_groups == n_groups:
        return sel_TE
    T, E = sel_TE.shape
    sel_TGe = sel_TE.view(T, n_groups, E // n_groups)
    top = min(2, E // n_groups)
    group_score_TG = sel_TGe.topk(top, dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
    keep_TG.scatter_(1, group_score_TG.topk(topk_groups, dim=-1).indices, True)
    masked = sel_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf"))
    return masked.view(T, E)


def topk_route(
    logits_TE: torch.Tensor,
    *,
    top_k: int,
    score_func: str = "softmax",
    pre_softmax: bool = True,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
    n_groups: int = 1,
    topk_groups: int = 1,
    bias_E: torch.Tensor | None = None,
    norm_top_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-choice top-k routing. Returns (ids_TK, weights_TK, scores_TE).

    `scores_TE` are the probabilities used by the aux loss and the monitor (softmax over all E for
    softmax routing, whatever `pre_softmax` says). `norm_top_k` (>= top_k; None = top_k): route the
    top `norm_top_k` and keep the first `top_k` slots, so the kept weights are normalised over the
    top `norm_top_k` (module note). norm_top_k = top_k >= 2 is the plain top-k, bit for bit.
    """
    post_softmax = score_func == "softmax" and not pre_softmax
    scores_TE = score_fn(logits_TE, score_func)
    # The choice is discrete and takes no gradient: selecting on a detached tensor keeps autograd
    # from saving top-k indices that no backward reads, and leaves exactly the saved tensors of
    # `weights_at`, which activation recompute relies on when it replays these ids (layers/recompute.py).
    sel_TE = (logits_TE if post_softmax else scores_TE).detach()
    if bias_E is not None:
        sel_TE = sel_TE + bias_E
    sel_TE = group_limited_mask(sel_TE, n_groups, topk_groups)
    n = top_k if norm_top_k is None else max(norm_top_k, top_k)
    # topk is deterministic on CPU; ties go to the lower expert index. sorted=True: the first top_k
    # of the top n are the top top_k.
    ids_TN = sel_TE.topk(n, dim=-1, sorted=True).indices
    weights_TN = _combine_weights(logits_TE, scores_TE, ids_TN, score_func, post_softmax, renormalize,
                                  scaling_factor, always=norm_top_k is not None)
    if n == top_k:
        return ids_TN, weights_TN, scores_TE
    return ids_TN[:, :top_k].contiguous(), weights_TN[:, :top_k].contiguous(), scores_TE


def _combine_weights(logits_TE: torch.Tensor, scores_TE: torch.Tensor, ids_TK: torch.Tensor,
                     score_func: str, post_softmax: bool, renormalize: bool, scaling_factor: float,
                     always: bool = False) -> torch.Tensor:
    """The unbiased weights at the chosen ids: softmax over the k logits (post-softmax), or the
    scores gathered and optionally renormalised to sum to 1 (not a single one unless `always`);
    then the routing scaling factor. Softmax scores renormalised over the chosen ids are the softmax
    of the chosen logits (module note), computed so."""
    renorm = renormalize and (ids_TK.shape[1] > 1 or always)
    if post_softmax or (renorm and score_func == "softmax"):
        weights_TK = torch.softmax(logits_TE.gather(1, ids_TK), dim=-1)
    else:
        weights_TK = scores_TE.gather(1, ids_TK)
        if renorm:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + _EPS)
    if scaling_factor != 1.0:
        weights_TK = weights_TK * scaling_factor
    return weights_TK


def weights_at(
    logits_TE: torch.Tensor,
    ids_TK: torch.Tensor,
    *,
    score_func: str = "softmax",
    pre_softmax: bool = True,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights for expert choices made elsewhere (routing replay, forced routing).

    The choices are taken as given; the weights are the current router's scores at those ids,
    processed exactly as `topk_route` would, so the router still receives a gradient.
    Returns (weights_TK, scores_TE).
    """
    scores_TE = score_fn(logits_TE, score_func)
    post_softmax = score_func == "softmax" and not pre_softmax
    return (_combine_weights(logits_TE, scores_TE, ids_TK, score_func, post_softmax, renormalize, scaling_factor),
            scores_TE)


def router_probs(scores_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Scores normalised to a distribution over experts (what the aux loss calls P)."""
    if score_func == "softmax":
        return scores_TE
    return scores_TE / (scores_TE.sum(-1, keepdim=True) + _EPS)


def expert_counts(ids_TK: torch.Tensor, num_experts: int, valid_TK: torch.Tensor | None = None) -> torch.Tensor:
    """Pairs routed to each expert, int64, on the device (no host sync). Invalid slots not counted."""
    if valid_TK is not None:
        ids_TK = torch.where(valid_TK, ids_TK, num_experts)  # out of range: not counted
    return bin_counts(ids_TK, num_experts)


# ---------------------------------------------------------------------------------------------------
# Strategies other than token-choice top-k. Each returns ids and weights in the dispatcher's form;
# the variable-count ones add valid_TK.


def score_quantile(scores_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """q_E: the score above which a fraction top_k / E of the tokens lie, per expert.

    An expert that admitted exactly the tokens scoring above q_e would take its fair share T*k/E.
    Linear interpolation between order statistics (torch.quantile's default).
    """
    T, E = scores_TE.shape
    return torch.quantile(scores_TE.detach().float(), 1.0 - top_k / E, dim=0)


def expert_choice_route(scores_TE: torch.Tensor, *, top_k: int, capacity_factor: float = 1.0,
                        scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert choice: each expert takes its C best-scoring tokens, C = ceil(factor * T * k / E) <= T.

    Returns (ids_TK, weights_TK, valid_TK) with K = E: slot e of token t is expert e, valid when e
    chose t. A token may get 0..E experts; every expert gets exactly C pairs. The choice of token t
    depends on every other token of the batch, later ones included: not causal.
    """
    T, E = scores_TE.shape
    C = min(T, math.ceil(capacity_factor * T * top_k / E))
    chosen_TE = torch.zeros_like(scores_TE, dtype=torch.bool)
    if C > 0:
        # topk over tokens is deterministic; ties go to the earlier token.
        chosen_TE.scatter_(0, scores_TE.detach().topk(C, dim=0).indices, True)
    ids_TE = torch.arange(E, device=scores_TE.device).expand(T, E).contiguous()
    weights_TE = scores_TE * chosen_TE * scaling_factor
    return ids_TE, weights_TE, chosen_TE


def threshold_route(scores_TE: torch.Tensor, threshold_E: torch.Tensor, ready: torch.Tensor, *,
                    top_k: int, max_slots: int | None = None, renormalize: bool = True,
                    scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert threshold: token t goes to every expert e with score_te > threshold_e.

    The thresholds come from previous batches (an EMA of `score_quantile`), so a token's experts
    depend on that token alone: no leak from later tokens. Its best expert (largest margin
    score - threshold) is always taken, so no token goes unprocessed. Until the thresholds have
    seen a batch (`ready` False, a 0-dim bool tensor: read on the device, no host sync) a token takes
    its token-choice top-k instead. Returns (ids_TK, weights_TK, valid_TK), K = max_slots or E;
    with a cap, a token over it keeps its `max_slots` largest margins.
    """
    T, E = scores_TE.shape
    M = max_slots or E
    s = scores_TE.detach()
    key_TE = torch.where(ready, s - threshold_E, s)
    key_TM, ids_TM = key_TE.topk(M, dim=-1, sorted=True)
    slot_M = torch.arange(M, device=s.device)
    valid_TM = torch.where(ready, (key_TM > 0) | (slot_M == 0), slot_M < top_k)
    weights_TM = scores_TE.gather(1, ids_TM) * valid_TM
    if renormalize:
        weights_TM = weights_TM / (weights_TM.sum(-1, keepdim=True) + _EPS)
    return ids_TM, weights_TM * scaling_factor, valid_TM


def make_hash_table(buckets: int, num_experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """A fixed table [buckets, K] of distinct experts per row, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(buckets, num_experts, generator=g).argsort(dim=-1)[:, :top_k].contiguous()


def hash_ids(token_ids_T: torch.Tensor, table_VK: torch.Tensor) -> torch.Tensor:
    """Hash routing: the experts of a token are a function of its id alone."""
    return table_VK[token_ids_T.reshape(-1) % table_VK.shape[0]]


def forced_balance_ids(num_tokens: int, num_experts: int, top_k: int, device: torch.device | str = "cpu",
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform random routing, balanced to within one pair per expert.

    Pair (t, j) of the shuffled token order gets expert (perm[t] * K + j + r) mod E: the T*K
    consecutive numbers hit every expert floor or ceil of T*K/E times, and a token's K consecutive
    values are distinct because K <= E. The random permutation and offset make it uniform.

    Both draws happen on `device` (from its default generator, or `generator`, which must live
    there): no host-made tensor to copy over and no offset read back on the host inside a step.
    """
    perm_T = torch.randperm(num_tokens, generator=generator, device=device)
    r_1 = torch.randint(num_experts, (1,), generator=generator, device=device)
    slots_K = torch.arange(top_k, device=device)
    return (perm_T[:, None] * top_k + slots_K + r_1) % num_experts


def switch_aux_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int,
                    probs_mean_E: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-style load-balancing loss, without its coefficient: E * sum_e f_e * P_e.

    f_e = fraction of the T*K routed pairs that went to e (no gradient: it comes from a discrete
    choice); P_e = mean router probability of e (carries the gradient). Reads 1.0 at perfect balance.
    Note it also reads its minimum when P is flat at 1/E whatever the real loads: judge balance by
    MaxVio from real counts, never by this loss. `probs_mean_E`: P when the caller has it already.
    Computed as one dot product of P with the counts scaled by E / (T*K) (the int64 counts promote
    to float in that multiply): two ops where the cast, the division, the product, the sum and the
    factor E were five; the same value up to the order of the roundings (a few fp32 ulps).
    """
    T, E = probs_TE.shape
    P_E = probs_TE.mean(0) if probs_mean_E is None else probs_mean_E
    scale = E / max(T * top_k, 1)
    # E * f_e; integer counts times a float promote to the default dtype: cast first where that is not P's
    promoted = counts_E.dtype if counts_E.is_floating_point() else torch.get_default_dtype()
    f_E = (counts_E if promoted == P_E.dtype else counts_E.to(P_E.dtype)) * scale
    return torch.dot(f_E, P_E)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss without its coefficient: mean_T(logsumexp(logits)^2)."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()
