"""The decode-time expert path: gather each pair's expert weights and run one batched matmul.

Legend: T tokens, K experts per token, P = T*K pairs (token-major), D model width, E experts,
F expert width (2F for the gated first GEMM).

At decode time T is the batch size (one new token per sequence). The grouped path then pays a
routing plan (a sort, counts, a cumulative sum), a gather into expert order and one GEMM per expert
group for a handful of rows, and a scatter back: mostly fixed costs. Here each pair instead gathers
its expert's matrices (w_gate_up_EDF[ids] -> [P, D, 2F], w_down_EFD[ids] -> [P, F, D]) and runs two
bmm's with one row per matrix; the K rows of a token sit side by side and are summed. No plan, no
permutation, no host read.

Its cost grows with the pairs: the gather copies P expert matrices, where the grouped path reads each
of the E matrices once. So the gather pays only while P is small next to the fixed costs it saves;
`DECODE_MAX_TOKENS` is where it stopped paying when measured (`dropless bench generate`, the MoE
path table, and docs/serving.md "## Generation").

Numerics: the same operations as the grouped path on the same numbers (the first GEMM, the
activation with the routing weight folded in before the down GEMM, the down GEMM, a sum of a token's
K rows), but through bmm instead of grouped_mm, so results differ by the BLAS's rounding of a
reordered dot product (tests/tolerances.py REFERENCE), not bit for bit.

Applies only where the layer is a plain single-device dropless layer: full-precision experts (the
quantised recipes quantise per expert group), no capacity layout (it drops pairs by position in
the expert's group), token-choice-shaped decisions (no validity mask), a local dispatcher (expert
parallel moves pairs between ranks), and no detailed statistics (they read the expert-ordered rows).
"""

from __future__ import annotations

import torch

from ..ops import quant_gemm
from ..ops.activations import activation, weighted_swiglu
from .dispatch import DispatchMeta, LocalDispatcher
from .experts import GroupedExperts
from .router import RoutingDecision

# Calls of at most this many tokens take the gather path, per device type (measured with
# `dropless bench generate`'s MoE path table at the default preset's shapes, D = F = 256, E = 8, K = 2;
# figures in docs/serving.md "## Generation"). CPU: the gather's weight copy (~100 us per call for two
# pairs) costs about what the plan and per-expert GEMM calls it saves, so it pays at T = 1 only and
# loses from T = 2. CUDA: see the docs for the measured row; the grouped path's fixed kernel launches
# (sort, counts, cumsum, permute, grouped GEMM, scatter) dominate at batch-size token counts.
DECODE_MAX_TOKENS = {"cpu": 1, "cuda": 16}


def default_max_tokens(device: torch.device) -> int:
    return DECODE_MAX_TOKENS.get(device.type, 0)


def gathered_experts(x_TD: torch.Tensor, decision: RoutingDecision, experts: GroupedExperts) -> torch.Tensor:
    """The routed experts' weighted sum per token, y_TD, by gathered weights and bmm."""
    T, K = decision.ids_TK.shape
    ids_P = decision.ids_TK.reshape(-1)
    # Gather first, cast after: under autocast bmm casts its operands itself (P matrices, not all E,
    # as GroupedExperts must for grouped_mm); outside it the rows take the weights' dtype, as there.
    w1_PD2F, w2_PFD = experts.w_gate_up_EDF[ids_P], experts.w_down_EFD[ids_P]
    dev = x_TD.device.type
    autocast = torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)
    if not autocast and x_TD.dtype != w1_PD2F.dtype:
        x_TD = x_TD.to(w1_PD2F.dtype)
    x_P1D = x_TD.repeat_interleave(K, dim=0).unsqueeze(1)  # pair p = t * K + k reads token t
    h_P2F = torch.bmm(x_P1D, w1_PD2F).squeeze(1)
    weights_P = decision.weights_TK.reshape(-1)
    if experts.kind == "swiglu" and experts.clamp is None and experts.softcap is None:
        h_PF = weighted_swiglu(h_P2F, weights_P)
    else:
        h_PF = activation(h_P2F, experts.kind, experts.clamp, experts.softcap)
        h_PF = h_PF * weights_P.to(h_PF.dtype).unsqueeze(-1)
    y_PD = torch.bmm(h_PF.unsqueeze(1), w2_PFD).squeeze(1)
    return y_PD.view(T, K, -1).sum(1)


def applies(experts: GroupedExperts, dispatcher: object, decision: RoutingDecision, n_tokens: int,
            max_tokens: int | None, detailed_stats: bool) -> bool:
    """Whether a layer call takes the gather path (host-side facts only: no device read).
    `max_tokens` None: `DECODE_MAX_TOKENS` of the device."""
    if max_tokens is None:
        max_tokens = default_max_tokens(decision.ids_TK.device)
    return (n_tokens <= max_tokens and decision.valid_TK is None and not detailed_stats
            and experts.precision == quant_gemm.FULL_PRECISION
            and type(dispatcher) is LocalDispatcher and dispatcher.capacity_factor is None)


def no_drop_meta(decision: RoutingDecision, num_experts: int) -> DispatchMeta:
    """What the layer's statistics read from a dispatcher's metadata: nothing dropped, all E local."""
    zero = torch.zeros((), dtype=torch.int64, device=decision.ids_TK.device)
    return DispatchMeta(pairs_dropped=zero, first_expert=0, num_local=num_experts)
