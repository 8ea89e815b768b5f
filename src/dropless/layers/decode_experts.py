"""The decode-time expert path: each pair reads its expert's weight rows in place, no routing plan.

Legend: T tokens, K experts per token, P = T*K pairs (token-major: p = t*K + k), D model width,
E experts, F expert width, W the first GEMM's width (2F gated, F otherwise).

At decode time T is the batch size (one new token per sequence). The grouped path then pays a
routing plan (a sort, counts, a cumulative sum), a gather into expert order, one GEMM call per expert
(empty groups included, on CPU) and a scatter back: mostly fixed costs for a handful of rows. Here
both expert GEMMs are weighted sums of weight rows, which `embedding_bag` computes without copying
the weights:
- h[p] = sum_d x[t, d] * w_gate_up[e_p, d, :]: one bag per pair, the D rows of expert e_p's matrix
  (rows e_p*D + d of the [E*D, W] view), each weighted by the token's activation x[t, d];
- y[t] = sum_k sum_f a[p, f] * w_down[e_p, f, :]: one bag per token, the K*F rows of its experts'
  down matrices weighted by the activation a (routing weight folded in before the down GEMM, as the
  grouped path does), so the down GEMM and the combine are one call.
No plan, no permutation, no host read; gradients flow to the weights and to x through the bags.
What was measured against it (CPU, D = F = 256, E = 8, K = 2, one token): gathering the chosen
experts' matrices (index_select, [P, D, W]) and two bmm's costs 2.5x the bags (the copy of
whole matrices dominates); a dense product through all E experts (weight 0 off the chosen ones)
reads E matrices instead of K and was slower still at T = 1.

Its cost grows with the pairs (each bag walks D or K*F rows one by one), where the grouped path's
GEMMs reuse each expert's weights across its rows; `DECODE_MAX_TOKENS` is where it stopped paying
when measured (`dropless bench generate`, the MoE path table; docs/generation.md "What it does").

Numerics: the same products as the grouped path on the same numbers, summed in another order (a
row walk instead of a blocked GEMM, the K pairs of a token inside one sum instead of a combine
afterwards): results differ by reordered fp32 sums (tests/tolerances.py REFERENCE), not bit for bit.

Applies only where the layer is a plain single-device dropless layer in its weights' dtype:
`GroupedExperts` (not the 4-bit `PackedExperts`, which dequantise per step), full-precision experts
(the quantised recipes quantise per expert group), no autocast (the grouped path casts all E
matrices to the autocast dtype; doing that here would cost more than it saves), no capacity layout
(it drops pairs by position in the expert's group), token-choice-shaped decisions (no validity
mask), no LoRA adapters on the experts and no frozen base held narrow (train.lora), a dispatcher
that allows it (`Dispatcher.allows_decode_path`: the local dropless one; expert parallel moves
pairs between ranks), and no detailed statistics (they read the expert-ordered rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import quant_gemm
from ..ops.autocast import autocast_available
from ..ops.activations import activation, weighted_swiglu
from .dispatch import DispatchMeta, Dispatcher
from .experts import GroupedExperts
from .lora import has_expert_adapters
from .router import RoutingDecision

# Calls of at most this many tokens take the decode path, per device type (measured with
# `dropless bench generate`'s MoE path table and the layer alone at the default preset's shapes,
# D = F = 256, E = 8, K = 2; figures in docs/generation.md "What it does"). CPU, one thread, the layer
# alone, grouped vs decode: 0.57 vs 0.41 ms at T = 1, 0.77 vs 0.67 at T = 4, 0.98 vs 0.90 at T = 8,
# 1.04 vs 1.26 at T = 16: the bags walk D rows per pair where the GEMMs reuse each weight across
# rows. CUDA: 16 is a guess, not measured (no GPU here): the grouped path's dozen-odd kernel launches
# per layer should dominate at batch-size token counts; `dropless bench generate --device cuda`
# prints the table to set it from.
DECODE_MAX_TOKENS = {"cpu": 8, "cuda": 16}


def default_max_tokens(device: torch.device) -> int:
    return DECODE_MAX_TOKENS.get(device.type, 0)


def row_sum_experts(x_TD: torch.Tensor, decision: RoutingDecision, experts: GroupedExperts) -> torch.Tensor:
    """The routed experts' weighted sum per token, y_TD, as two weighted row-gather sums."""
    T, K = decision.ids_TK.shape
    w1_ED_W, w2_EFD = experts.w_gate_up_EDF, experts.w_down_EFD
    E, D, W = w1_ED_W.shape
    Fw = w2_EFD.shape[1]
    if x_TD.dtype != w1_ED_W.dtype:
        x_TD = x_TD.to(w1_ED_W.dtype)
    ids_P = decision.ids_TK.reshape(-1)  # pair p = t * K + k
    dev = ids_P.device
    # first GEMM: h[p] = sum_d x[t, d] * w1[e_p, d, :], i.e. a bag of pair p's D weight rows
    rows_PD = (ids_P.unsqueeze(1) * D + torch.arange(D, device=dev)).reshape(-1)
    coef_PD = x_TD.repeat_interleave(K, dim=0).reshape(-1)
    starts_P = torch.arange(0, ids_P.numel() * D, D, device=dev)
    h_PW = F.embedding_bag(rows_PD, w1_ED_W.reshape(E * D, W), starts_P, mode="sum",
                           per_sample_weights=coef_PD)
    weights_P = decision.weights_TK.reshape(-1)
    if experts.kind == "swiglu" and experts.clamp is None and experts.softcap is None:
        h_PF = weighted_swiglu(h_PW, weights_P)
    else:
        h_PF = activation(h_PW, experts.kind, experts.clamp, experts.softcap)
        h_PF = h_PF * weights_P.to(h_PF.dtype).unsqueeze(-1)
    # down GEMM and the sum over a token's K pairs in one bag per token: its K x F rows of w2
    rows_PF = (ids_P.unsqueeze(1) * Fw + torch.arange(Fw, device=dev)).reshape(-1)
    starts_T = torch.arange(0, T * K * Fw, K * Fw, device=dev)
    return F.embedding_bag(rows_PF, w2_EFD.reshape(E * Fw, -1), starts_T, mode="sum",
                           per_sample_weights=h_PF.reshape(-1))


def applies(experts: torch.nn.Module, dispatcher: Dispatcher, decision: RoutingDecision, n_tokens: int,
            max_tokens: int | None, detailed_stats: bool) -> bool:
    """Whether a layer call takes the decode path (host-side facts only: no device read).
    `max_tokens` None (the automatic choice): `DECODE_MAX_TOKENS` of the device, and only without
    autograd. Training never runs batch-size token counts, and this keeps every training call and
    every parity test of the layer (expert parallel against one process, ...) on the grouped path
    whatever its token count; a set `max_tokens` is honoured with autograd too (the tests compare
    the two paths' gradients)."""
    dev = decision.ids_TK.device
    if max_tokens is None:
        max_tokens = default_max_tokens(dev) if not torch.is_grad_enabled() else 0
    autocast = autocast_available(dev.type) and torch.is_autocast_enabled(dev.type)
    return (0 < n_tokens <= max_tokens and not autocast and type(experts) is GroupedExperts
            and not has_expert_adapters(experts) and experts.dequant_base is None
            and decision.valid_TK is None and not detailed_stats
            and experts.precision == quant_gemm.FULL_PRECISION
            and dispatcher.allows_decode_path)


def no_drop_meta(decision: RoutingDecision, num_experts: int) -> DispatchMeta:
    """What the layer's statistics read from a dispatcher's metadata: nothing dropped, all E local."""
    return DispatchMeta(pairs_dropped=None, first_expert=0, num_local=num_experts)
