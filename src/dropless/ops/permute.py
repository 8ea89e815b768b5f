"""Routing plan, permute (tokens -> expert-ordered rows) and combine (rows -> tokens).

Legend: T tokens, K experts per token, P = T*K (token, slot) pairs, indexed p = t*K + j;
R rows of the expert-ordered buffer (P plus alignment padding, or E*C in capacity mode); D model width.
    ids_TK      chosen experts
    counts_E    pairs routed to each expert (int64)
    offsets_E   end row of each expert's group in the buffer (int32, cumulative, on the device)
    row_of_P    buffer row that holds pair p
    pair_of_R   pair held by row r; P marks a padding row (it reads a zero input row)
    bags_T      t*K: where token t's K pairs start, the bag offsets of the gather-sums
    valid_TK    optional mask of real pairs (strategies with a variable number of experts per token):
                invalid pairs get no row in any expert's group, weight 0 in combine, no gradient

Every index here is computed on the device from `ids_TK` with fixed-size ops (stable sort, binary search,
cumsum, gather), so a plan never needs the host to read counts: the row count R is a static bound
(P + E*(align-1) when groups are padded to `align` rows), not the exact padded total.

Permute and combine are autograd functions written as gathers in both directions: permute's backward
gathers each pair's row and sums the K slots in a fixed order, combine's backward gathers pairs back
into rows. No scatter-add anywhere, so results and gradients are bit-identical from call to call.
A gather followed by a sum over the K slots is one `embedding_bag(mode="sum")` call (`_gather_sum`):
the same sum, in slot order, without writing and re-reading a [P, D] temporary (on the 2-core CPU
that cut a 32 MB gather+sum from ~23 ms to ~1 ms, most of it the fresh allocation of the temporary).

Two forms of the way back:
- `combine(y_RD, weights_TK, plan)`: weights applied here (a K-way bmm per token), so its backward
  keeps the gathered [T, K, D] rows for the weight gradient.
- `unpermute(y_RD, plan)`: the adjoint of `permute`, an unweighted sum of each token's K rows, for
  experts that already multiplied row r by its weight (`permute_weights` gives them w_R). Its backward
  is a gather from the small [T, D] gradient and it saves nothing but indices: this is the fast path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RoutingPlan:
    num_tokens: int
    top_k: int
    num_experts: int
    num_rows: int  # R, static
    counts_E: torch.Tensor  # int64: pairs routed to each expert (before any drop)
    offsets_E: torch.Tensor  # int32: group ends in the buffer
    row_of_P: torch.Tensor  # int64 [P]
    pair_of_R: torch.Tensor  # int64 [R]; P = padding
    keep_P: torch.Tensor | None = None  # bool [P]: capacity mode only; False = dropped pair
    capacity: int | None = None  # rows per expert: capacity mode (ops/capacity_plan.py) or a uniform plan
    valid_P: torch.Tensor | None = None  # bool [P]: masked plans only; False = not a pair at all
    bags_T: torch.Tensor | None = None  # int64 [T]: t*K, where token t's K pairs start (`_gather_sum`)

    @property
    def mask_P(self) -> torch.Tensor | None:
        """Pairs that own a row (kept and valid); None when every pair does."""
        if self.keep_P is None:
            return self.valid_P
        return self.keep_P if self.valid_P is None else self.keep_P & self.valid_P

    @property
    def src_R(self) -> torch.Tensor:
        """Token of each row; T (a zero row) for padding, since P // K == T."""
        return self.pair_of_R // self.top_k

    def pairs_dropped(self) -> torch.Tensor | None:
        """int64 scalar: pairs past their expert's capacity; None for a dropless plan (none can be)."""
        return None if self.keep_P is None else (~self.keep_P).sum()


def _invert(order_P: torch.Tensor, steps: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse permutation. `steps`: an int64 arange of at least P values to read 0 .. P-1 from."""
    P = order_P.numel()
    if steps is None:
        steps = torch.arange(P, device=order_P.device)
    inv = torch.empty_like(order_P)
    inv[order_P] = steps if steps.numel() == P else steps[:P]
    return inv


def edges_of_sorted(sorted_N: torch.Tensor, num_bins: int, steps: torch.Tensor | None = None) -> torch.Tensor:
    """[num_bins + 1] int64: how many of the ascending keys are below each of 0 .. num_bins, so bin b
    holds keys [edges[b], edges[b+1]) and edges[1:] are the bins' ends. A binary search for every bin
    edge: no host sync on any device (CUDA's bincount reads the keys' min and max back to the host to
    size its output, which the dropless path must never do). `steps`: an arange of the keys' dtype
    with at least num_bins + 1 values to read the edges from (one arange the caller shares)."""
    if steps is None:
        steps = torch.arange(num_bins + 1, device=sorted_N.device, dtype=sorted_N.dtype)
    return torch.searchsorted(sorted_N, steps if steps.numel() == num_bins + 1 else steps[:num_bins + 1])


def counts_of_sorted(sorted_N: torch.Tensor, num_bins: int) -> torch.Tensor:
    """How many of the ascending keys equal each of 0 .. num_bins-1 (larger keys are not counted), int64."""
    return torch.diff(edges_of_sorted(sorted_N, num_bins))


def bin_counts(keys_N: torch.Tensor, num_bins: int) -> torch.Tensor:
    """`torch.bincount(keys, minlength=num_bins)[:num_bins]` without its host sync (a sort first)."""
    return counts_of_sorted(torch.sort(keys_N.reshape(-1)).values, num_bins)


def _aligned_rows(ids_P: torch.Tensor, order_P: torch.Tensor, counts_E: torch.Tensor,
                  align: int, padded_E: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows for the pairs in sorted order when each group is padded to a multiple of `align` (or to
    the given `padded_E` rows): (expert of each sorted pair, its row, the padded group ends)."""
    if padded_E is None:
        padded_E = (counts_E + (align - 1)) // align * align
    ends_E = torch.cumsum(padded_E, 0)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    ids_sorted = ids_P[order_P]
    rank = torch.arange(ids_P.numel(), device=ids_P.device) - start_E[ids_sorted]
    return ids_sorted, (ends_E - padded_E)[ids_sorted] + rank, ends_E


def make_plan(ids_TK: torch.Tensor, num_experts: int, align: int = 1,
              valid_TK: torch.Tensor | None = None, uniform_limit: float | None = None) -> RoutingPlan:
    """Dropless plan: every pair gets a row; groups padded to a multiple of `align` rows.

    `uniform_limit` (the CPU only, ops/grouped_gemm.py `uniform_limit`): when padding every group to
    the largest one's aligned size adds at most that factor of rows, every group gets that many rows
    C (`capacity` = C, R = E*C: the uniform layout a batched matmul takes, still dropless, since C
    holds the largest group). Deciding reads the counts on the host, which costs nothing on the CPU.

    With `valid_TK`, only valid pairs get rows: the invalid ones are sorted into a virtual expert E
    after the last group, whose rows are turned into padding (they read a zero row and nothing reads
    their output); an invalid pair points at row 0 and combine gives it weight 0. Row 0 is a
    computed row whenever at least one pair is valid, which every strategy guarantees.
    """
    if valid_TK is not None:
        return _make_masked_plan(ids_TK, num_experts, align, valid_TK, uniform_limit)
    T, K = ids_TK.shape
    P = T * K
    E = num_experts
    ids_P = ids_TK.reshape(-1)
    # Stable: within an expert, pairs stay in token order (determinism and position-based dropping).
    sorted_P, order_P = torch.sort(ids_P, stable=True)
    # one arange gives both the bin edges 0 .. E searched for and the inverse permutation's values
    # (int64 ids, the usual case; a kernel launch fewer per layer call)
    steps = (torch.arange(max(P, E + 1), device=ids_P.device)
             if align == 1 and ids_P.dtype == torch.int64 else None)
    edges_E1 = edges_of_sorted(sorted_P, E, steps)
    counts_E = torch.diff(edges_E1)
    if align == 1 and uniform_limit is None:  # the group ends are the bin edges: every id is < E
        return RoutingPlan(T, K, E, P, counts_E, edges_E1[1:].to(torch.int32), _invert(order_P, steps),
                           order_P, bags_T=_bags(T, K, ids_P.device))
    padded_E, C = _uniform(counts_E, align, uniform_limit)
    _, rows_sorted, ends_E = _aligned_rows(ids_P, order_P, counts_E, align, padded_E)
    R = P + E * (align - 1) if C is None else E * C  # static bound on sum(padded_E), or the uniform rows
    row_of_P = torch.empty_like(order_P)
    row_of_P[order_P] = rows_sorted
    pair_of_R = torch.full((R,), P, dtype=torch.int64, device=ids_P.device)
    pair_of_R[rows_sorted] = order_P
    return RoutingPlan(T, K, E, R, counts_E, ends_E.to(torch.int32), row_of_P, pair_of_R, capacity=C,
                       bags_T=_bags(T, K, ids_P.device))


def _uniform(counts_E: torch.Tensor, align: int, limit: float | None
             ) -> tuple[torch.Tensor | None, int | None]:
    """(rows of every group, C) for a uniform plan (`make_plan`'s `uniform_limit`), else (None, None)."""
    if limit is None:
        return None, None
    padded_E = (counts_E + (align - 1)) // align * align
    C, total = torch.stack([padded_E.max(), padded_E.sum()]).tolist()  # one host read: the CPU only
    if counts_E.numel() * C > limit * total:
        return None, None
    return torch.full_like(counts_E, C), C


def _make_masked_plan(ids_TK: torch.Tensor, num_experts: int, align: int,
                      valid_TK: torch.Tensor, uniform_limit: float | None = None) -> RoutingPlan:
    T, K = ids_TK.shape
    P, E = T * K, num_experts
    valid_P = valid_TK.reshape(-1)
    ids_P = torch.where(valid_P, ids_TK.reshape(-1), E)  # invalid pairs -> virtual expert E, last
    sorted_P, order_P = torch.sort(ids_P, stable=True)
    counts_all = counts_of_sorted(sorted_P, E + 1)
    padded_E, C = _uniform(counts_all[:E], align, uniform_limit)
    padded_all = None if C is None else torch.cat([padded_E, counts_all[E:]])  # the virtual group: cut off
    _, rows_sorted, ends_all = _aligned_rows(ids_P, order_P, counts_all, align, padded_all)
    # static bound: valid pairs plus the real groups' padding; or the uniform rows
    R = P + E * (align - 1) if C is None else E * C
    valid_sorted = valid_P[order_P]
    # Invalid pairs' rows go to an extra row R, cut off below.
    pair_of_R = torch.full((R + 1,), P, dtype=torch.int64, device=ids_P.device)
    pair_of_R[torch.where(valid_sorted, rows_sorted, R)] = order_P
    row_of_P = torch.empty_like(order_P)
    row_of_P[order_P] = torch.where(valid_sorted, rows_sorted, 0)
    counts_E = counts_all[:E]
    return RoutingPlan(T, K, E, R, counts_E, ends_all[:E].to(torch.int32), row_of_P,
                       pair_of_R[:R].clone(), capacity=C, valid_P=valid_P, bags_T=_bags(T, K, ids_P.device))


def _bags(T: int, K: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, T * K, K, device=device)


def _gather_sum(src_RD: torch.Tensor, row_of_P: torch.Tensor, top_k: int,
                keep_P: torch.Tensor | None = None, bags_T: torch.Tensor | None = None) -> torch.Tensor:
    """out_TD[t] = sum_j keep[t, j] * src_RD[row_of_P[t*K + j]], as one fused gather-reduce.

    `bags_T`: the plan's bag starts, made once per plan for its three gather-sums (the forward's
    combine and the two backward ones); without them `F.embedding_bag` makes them for a 2-D input on
    every call. One slot per bag and no mask is a plain gather (the same values; a -0.0 stays -0.0,
    where the bag sum would give +0.0)."""
    if top_k == 1 and keep_P is None:
        return src_RD.index_select(0, row_of_P)
    keep = None if keep_P is None else keep_P.to(src_RD.dtype)
    if bags_T is None:
        T = row_of_P.numel() // top_k
        keep = None if keep is None else keep.view(T, top_k)
        return F.embedding_bag(row_of_P.view(T, top_k), src_RD, mode="sum", per_sample_weights=keep)
    return F.embedding_bag(row_of_P, src_RD, bags_T, mode="sum", per_sample_weights=keep)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, src_R: torch.Tensor, row_of_P: torch.Tensor, top_k: int,
                padded: bool, keep_P: torch.Tensor | None = None, bags_T: torch.Tensor | None = None) -> torch.Tensor:
        ctx.save_for_backward(row_of_P, keep_P, bags_T)
        ctx.top_k = top_k
        if padded:
            x_TD = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])
        return x_TD.index_select(0, src_R)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        row_of_P, keep_P, bags_T = ctx.saved_tensors
        # A dropped or invalid pair's row_of_P is row 0, another pair's gradient: the mask zeroes it.
        grad_TD = _gather_sum(grad_RD, row_of_P, ctx.top_k, keep_P, bags_T)
        if keep_P is not None:
            # When no pair of the batch owns a row (every pair on identity experts), row 0 is no
            # computed row: its gradient is whatever the grouped GEMM left there (uninitialised,
            # possibly NaN), and 0 * NaN is NaN. A token with no row takes an exact zero instead;
            # for every other token this select returns the sum unchanged.
            grad_TD = torch.where(keep_P.view(-1, ctx.top_k).any(-1, keepdim=True), grad_TD, 0)
        return grad_TD, None, None, None, None, None, None


def permute(x_TD: torch.Tensor, plan: RoutingPlan, src_R: torch.Tensor | None = None) -> torch.Tensor:
    """Gather token rows into expert order: x_RD. Padding rows are zeros. `src_R`: `plan.src_R`
    when the caller already has it (one index tensor instead of a new one per call)."""
    src_R = plan.src_R if src_R is None else src_R
    return _Permute.apply(x_TD, src_R, plan.row_of_P, plan.top_k, has_padding(plan), plan.mask_P, plan.bags_T)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RD: torch.Tensor, weights_TK: torch.Tensor, row_of_P: torch.Tensor,
                pair_of_R: torch.Tensor, padded: bool) -> torch.Tensor:
        T, K = weights_TK.shape
        y_TKD = y_RD.index_select(0, row_of_P).view(T, K, y_RD.shape[1])  # explicit D: T may be 0
        w_T1K = weights_TK.to(y_RD.dtype).unsqueeze(1)
        ctx.save_for_backward(y_TKD, w_T1K, pair_of_R)
        ctx.w_dtype = weights_TK.dtype
        ctx.padded = padded
        return torch.bmm(w_T1K, y_TKD).squeeze(1)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        y_TKD, w_T1K, pair_of_R = ctx.saved_tensors
        T, K, D = y_TKD.shape
        grad_T1D = grad_TD.unsqueeze(1).to(y_TKD.dtype)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.bmm(grad_T1D, y_TKD.transpose(1, 2)).squeeze(1).to(ctx.w_dtype)
        grad_y = None
        if ctx.needs_input_grad[0]:
            g_PD = (w_T1K.transpose(1, 2) * grad_T1D).view(T * K, D)
            if ctx.padded:  # row P: padding rows get zero gradient (a full copy, so only when needed)
                g_PD = torch.cat([g_PD, g_PD.new_zeros(1, D)])
            grad_y = g_PD.index_select(0, pair_of_R)
        return grad_y, grad_w, None, None, None


def has_padding(plan: RoutingPlan) -> bool:
    """Whether pair_of_R holds the padding index P (static: no device read)."""
    return plan.num_rows != plan.num_tokens * plan.top_k or plan.mask_P is not None


def combine(y_RD: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """out_TD = sum_j weights_TK[t, j] * y_RD[row of (t, j)]; dropped and invalid pairs count zero."""
    if plan.mask_P is not None:
        weights_TK = weights_TK * plan.mask_P.view_as(weights_TK)
    return _Combine.apply(y_RD, weights_TK, plan.row_of_P, plan.pair_of_R, has_padding(plan))


def unpermute(y_RD: torch.Tensor, plan: RoutingPlan, src_R: torch.Tensor | None = None) -> torch.Tensor:
    """out_TD = sum_j y_RD[row of (t, j)]: the adjoint of `permute`, for rows already weighted.

    Dropped pairs of a capacity plan count zero (their row_of_P points at row 0, which holds another
    pair, so they are masked out). `src_R` as in `permute` (its backward keeps it: pass the one
    the experts keep too, and the two share a storage)."""
    src_R = plan.src_R if src_R is None else src_R
    return _Unpermute.apply(y_RD, plan.row_of_P, src_R, plan.mask_P, plan.top_k, has_padding(plan), plan.bags_T)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RD: torch.Tensor, row_of_P: torch.Tensor, src_R: torch.Tensor,
                keep_P: torch.Tensor | None, top_k: int, padded: bool,
                bags_T: torch.Tensor | None = None) -> torch.Tensor:
        ctx.save_for_backward(src_R)
        ctx.padded = padded
        return _gather_sum(y_RD, row_of_P, top_k, keep_P, bags_T)


    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        (src_R,) = ctx.saved_tensors
        if ctx.padded:
            grad_TD = torch.cat([grad_TD, grad_TD.new_zeros(1, grad_TD.shape[1])])
        # Every row holds a kept pair (or padding, reading the zero row T): no mask needed here.
        return grad_TD.index_select(0, src_R), None, None, None, None, None, None


def permute_weights(weights_TK: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """w_R: the combine weight of the pair in each row, 0 for padding rows.

    A permute with one slot per "token" (a token is a pair here), so its backward is again a gather;
    dropped pairs of a capacity plan get no row and a zero gradient.
    """
    w_P1 = weights_TK.reshape(-1, 1)
    return _Permute.apply(w_P1, plan.pair_of_R, plan.row_of_P, 1, has_padding(plan), plan.mask_P).view(-1)
