"""Routing-health statistics: device-side accumulation per step, one host sync per log interval.

Legend: L MoE layers, E experts, T tokens, K experts per token.
    counts_LE  pairs routed to each expert of each layer

The layers return device tensors (MoEStats); `StepAccumulator` sums them over a step's
micro-batches and over the steps of a log interval without reading anything on the host, and
`record()` turns one log interval into the `routing.jsonl` row documented in docs/monitoring.md,
with a single device-to-host copy. The flip-rate probes are separate functions the trainer calls on
log steps only. Host-side helpers (maxvio, rms_ratios, load_summary) take plain lists so the report
and the alarms can recompute them from files.

MaxVio = max_e load_e / mean_e load_e - 1. Local: the worst micro-batch of the interval (on one
rank); global: the worst optimizer step, counts summed over the step's micro-batches and ranks. A
global 0.9 can hide a local 6: the experts' compute is ragged per micro-batch.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

from ..layers.balance import maxvio as maxvio_device
from ..layers.moe import MoEStats
from ..layers.router import Router
from ..ops import routing


def maxvio(counts_E: Sequence[float]) -> float:
    mean = sum(counts_E) / max(len(counts_E), 1)
    return max(counts_E) / mean - 1.0 if mean > 0 else 0.0


def load_summary(counts_E: Sequence[float]) -> tuple[float, float, float]:
    """(min, median, max) tokens per expert."""
    return float(min(counts_E)), float(statistics.median(counts_E)), float(max(counts_E))


def rms_ratios(out_sq_E: Sequence[float], counts_E: Sequence[float]) -> tuple[float | None, float | None]:
    """(max / median, min / median) of the per-expert output RMS, over experts that got rows.

    RMS_e = sqrt(out_sq_e / counts_e): the root mean square of expert e's output entries. Experts
    without rows have no RMS (the dead-expert rule covers them). None when no expert has rows or the
    median RMS is 0.
    """
    rms = [(s / c) ** 0.5 for s, c in zip(out_sq_E, counts_E) if c > 0]
    if not rms:
        return None, None
    med = statistics.median(rms)
    if med <= 0:
        return None, None
    return max(rms) / med, min(rms) / med


def flip_rate(ids_a_TK: torch.Tensor, ids_b_TK: torch.Tensor, valid_a_TK: torch.Tensor | None = None,
              valid_b_TK: torch.Tensor | None = None, num_experts: int | None = None) -> torch.Tensor:
    """Fraction of tokens whose set of experts differs between two routings of the same tokens
    (slot order ignored). A device scalar. Used step to step on a fixed probe batch."""
    E = num_experts or int(max(int(ids_a_TK.max()), int(ids_b_TK.max()))) + 1
    a = _expert_set_TE(ids_a_TK, valid_a_TK, E)
    b = _expert_set_TE(ids_b_TK, valid_b_TK, E)
    return (a != b).any(-1).float().mean()


def _expert_set_TE(ids_TK: torch.Tensor, valid_TK: torch.Tensor | None, E: int) -> torch.Tensor:
    hot_TKE = torch.nn.functional.one_hot(ids_TK, E).bool()
    if valid_TK is not None:
        hot_TKE = hot_TKE & valid_TK.unsqueeze(-1)
    return hot_TKE.any(1)


@torch.no_grad()
def bf16_flip_rate(router: Router, x_TD: torch.Tensor) -> torch.Tensor:
    """Fraction of tokens whose token-choice top-k set changes when the router GEMM runs in bf16
    (input and weight cast to bf16, product rounded to bf16) instead of fp32. A device scalar.
    Measures how close to ties the router runs: a rising rate means a bf16 router would flip."""
    c = router.cfg
    kw = dict(top_k=router.top_k, score_func=c.score_func, pre_softmax=c.pre_softmax,
              n_groups=c.n_groups, topk_groups=c.topk_groups, bias_E=router.expert_bias)
    logits32 = torch.nn.functional.linear(x_TD.float(), router.weight.float())
    logits16 = torch.nn.functional.linear(x_TD.bfloat16(), router.weight.bfloat16()).float()
    ids32, _, _ = routing.topk_route(logits32, **kw)
    ids16, _, _ = routing.topk_route(logits16, **kw)
    return flip_rate(ids32, ids16, num_experts=router.num_experts)


# the sums behind the interval means; checkpoints written before they existed lack them (load_state_dict)
MEAN_SUMS = ("maxvio_global_sum_L", "maxvio_worst_sum", "global_steps")


class StepAccumulator:
    """Device-side sums of the layers' statistics over micro-batches, steps and one log interval.

    Per optimizer step: `begin_step()`; per micro-batch `add(layer, out.stats, out.aux_loss)` for
    every MoE layer; then all-reduce `step_counts_LE` (sum) over data-parallel ranks if any (the
    global aux loss and the bias rules need the same sum) and `end_step(skip, nonfinite)`.

    A step the trainer skipped (`skip`, a device bool: non-finite loss or gradient, or buffered EP
    overflow without retry) is left out of the interval: its counts, MaxVio, aux loss, output and
    router statistics are restored to their values at `begin_step` on the device, except its dropped
    pairs, which are why an EP step is skipped and must show. The record counts the interval's
    skipped steps (`skipped_steps`) and those skipped for a non-finite loss or gradient
    (`nonfinite_steps`). So the record's counts are those of the applied steps, the ones the router
    buffers learned from.
    Per log interval: `all_reduce(fn)` over data-parallel ranks, then `record(step, ...)` (one host
    sync), which also resets the interval.

    Which interval tensors are per rank and which already global: `counts_LE`, `maxvio_global_L`
    and the sums behind its means (MEAN_SUMS) are built from the step counts after their
    all-reduce, so they are global
    (identical on every rank) and must not be reduced again (summing them over W ranks made the
    record's counts W times too large). Everything `add` accumulates per micro-batch is this rank's
    own: sums (dropped pairs, aux-loss sums and their count, output sums of squares with the counts
    they go with, entropy and top-1/top-2 sums and their count) are summed over ranks, the local
    MaxVio takes the max. Under expert parallelism a rank's `out_sq_E` covers its own experts (the
    rows it received from its EP group) and zeros elsewhere, so the sum over all ranks counts each
    row once, like `detail_counts_LE` counts each token once.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int,
                 device: torch.device | str = "cpu") -> None:
        self.L, self.E, self.top_k, self.device = num_layers, num_experts, top_k, device
        z = lambda *s: torch.zeros(*s, device=device)  # noqa: E731
        self.step_counts_LE = z(num_layers, num_experts)
        # interval tensors
        self.counts_LE = z(num_layers, num_experts)
        self.maxvio_local_L = z(num_layers)
        self.maxvio_global_L = z(num_layers)
        # the interval's per-step global MaxVio summed (per layer, and the worst layer's each step) over
        # its applied steps, for the mean: the max above is one bad step, the mean is the balance the
        # interval had (bench balance's measure: the worst layer each step, averaged over steps)
        self.maxvio_global_sum_L, self.maxvio_worst_sum, self.global_steps = z(num_layers), z(()), z(())
        self.dropped_L = z(num_layers)
        self.aux_sum_L, self.aux_n_L = z(num_layers), z(num_layers)
        self.out_sq_LE = z(num_layers, num_experts)
        self.detail_counts_LE = z(num_layers, num_experts)  # counts of the calls that had out_sq
        self.entropy_sum_L, self.top12_sum_L, self.detail_n_L = z(num_layers), z(num_layers), z(num_layers)
        self.skipped_steps, self.nonfinite_steps = z(()), z(())  # global: the flags agree over ranks
        self._at_begin: dict[str, torch.Tensor] | None = None  # the interval at begin_step (class note)

    def begin_step(self) -> None:
        """Remember the interval as it stands, so that `end_step(skip)` can leave the step out."""
        self._at_begin = {n: t.clone() for n, (t, _) in self.interval_tensors().items()}

    def add(self, layer: int, stats: MoEStats, aux_loss: torch.Tensor | None = None) -> None:
        counts = stats.tokens_per_expert_E.detach().float()
        self.step_counts_LE[layer] += counts
        self.maxvio_local_L[layer] = torch.maximum(self.maxvio_local_L[layer], maxvio_device(counts))
        if stats.pairs_dropped is not None:  # None: the layer's path cannot drop
            self.dropped_L[layer] += stats.pairs_dropped.float()
        if aux_loss is not None:
            self.aux_sum_L[layer] += aux_loss.detach().float()
            self.aux_n_L[layer] += 1
        if stats.out_sq_E is not None:
            self.out_sq_LE[layer] += stats.out_sq_E.float()
            self.detail_counts_LE[layer] += counts
        if stats.router_entropy is not None:
            self.entropy_sum_L[layer] += stats.router_entropy.float()
            self.top12_sum_L[layer] += stats.top1_top2_ratio.float()
            self.detail_n_L[layer] += 1

    def end_step(self, skip: torch.Tensor | None = None, nonfinite: torch.Tensor | None = None) -> None:
        """Close the step; `skip` / `nonfinite`: device bools from the trainer (class note)."""
        step = self.step_counts_LE
        vio_L = torch.stack([maxvio_device(step[i]) for i in range(self.L)])
        self.maxvio_global_L = torch.maximum(self.maxvio_global_L, vio_L)
        self.maxvio_global_sum_L += vio_L
        self.maxvio_worst_sum += vio_L.max()
        self.global_steps += 1
        self.counts_LE += step
        step.zero_()
        if skip is not None:
            if self._at_begin is None:
                raise RuntimeError("StepAccumulator.end_step(skip): begin_step() was not called")
            for name, (t, _) in self.interval_tensors().items():
                if name not in ("dropped_L", "skipped_steps", "nonfinite_steps"):
                    t.copy_(torch.where(skip, self._at_begin[name], t))
            self.skipped_steps += skip
        if nonfinite is not None:
            self.nonfinite_steps += nonfinite
        self._at_begin = None

    def interval_tensors(self) -> dict[str, tuple[torch.Tensor, str]]:
        """The interval's tensors: name -> (tensor, how `all_reduce` combines it over data-parallel
        ranks: "sum", "max", or "global" for tensors that already span all ranks)."""
        t = {n: (getattr(self, n), "sum") for n in (
            "dropped_L", "aux_sum_L", "aux_n_L", "out_sq_LE", "detail_counts_LE",
            "entropy_sum_L", "top12_sum_L", "detail_n_L")}
        t["maxvio_local_L"] = (self.maxvio_local_L, "max")
        t["counts_LE"] = (self.counts_LE, "global")
        t["maxvio_global_L"] = (self.maxvio_global_L, "global")
        for n in MEAN_SUMS:
            t[n] = (getattr(self, n), "global")
        t["skipped_steps"] = (self.skipped_steps, "global")
        t["nonfinite_steps"] = (self.nonfinite_steps, "global")
        return t

    def record(self, step: int, *, flip_bf16: Sequence[float | torch.Tensor | None] | None = None,
               flip_step: Sequence[float | torch.Tensor | None] | None = None,
               overflow: Sequence[int | torch.Tensor | None] | None = None,
               bias: Sequence[torch.Tensor | None] | None = None) -> dict:
        """The routing.jsonl row for this log interval; resets the interval. Per-layer optional
        inputs: probe flip rates, EP buffer overflow counts, expert bias tensors."""
        L = self.L
        per_layer = lambda seq: list(seq) if seq is not None else [None] * L  # noqa: E731
        fb, fs, ov, bs = per_layer(flip_bf16), per_layer(flip_step), per_layer(overflow), per_layer(bias)
        dev = lambda v: torch.as_tensor(float("nan") if v is None else v, dtype=torch.float32,  # noqa: E731
                                        device=self.device).reshape(())
        bias_max = [dev(None) if b is None else b.detach().abs().max().float() for b in bs]
        # one host sync for everything
        host = torch.cat([
            self.counts_LE.view(-1), self.out_sq_LE.view(-1), self.detail_counts_LE.view(-1),
            self.maxvio_local_L, self.maxvio_global_L, self.dropped_L, self.aux_sum_L, self.aux_n_L,
            self.entropy_sum_L, self.top12_sum_L, self.detail_n_L,
            torch.stack([dev(v) for v in fb]), torch.stack([dev(v) for v in fs]),
            torch.stack([dev(v) for v in ov]), torch.stack(bias_max),
            self.maxvio_global_sum_L, self.maxvio_worst_sum.reshape(1), self.global_steps.reshape(1),
            self.skipped_steps.reshape(1), self.nonfinite_steps.reshape(1),
        ]).tolist()
        LE = L * self.E
        counts, out_sq, dcounts = host[:LE], host[LE:2 * LE], host[2 * LE:3 * LE]
        cols = [host[3 * LE + i * L: 3 * LE + (i + 1) * L] for i in range(13)]
        vl, vg, dropped, aux_s, aux_n, ent, t12, dn, fbh, fsh, ovh, bmh, vsum = cols
        worst_sum, n_steps = host[-4], host[-3]
        mean = lambda v: v / n_steps if n_steps else None  # noqa: E731
        nan = lambda v: None if v != v else v  # noqa: E731
        layers = []
        for i in range(L):
            c = [int(v) for v in counts[i * self.E:(i + 1) * self.E]]
            lo, med, hi = load_summary(c)
            rmax, rmin = (rms_ratios(out_sq[i * self.E:(i + 1) * self.E], dcounts[i * self.E:(i + 1) * self.E])
                          if dn[i] > 0 else (None, None))
            layers.append({
                "counts": c, "maxvio_local": vl[i], "maxvio_global": vg[i], "maxvio_global_mean": mean(vsum[i]),
                "tokens_min": lo, "tokens_median": med, "tokens_max": hi,
                "rms_max_over_median": rmax, "rms_min_over_median": rmin,
                "entropy": ent[i] / dn[i] if dn[i] else None,
                "top1_top2": t12[i] / dn[i] if dn[i] else None,
                "flip_bf16": nan(fbh[i]), "flip_step": nan(fsh[i]),
                "dropped": int(dropped[i]), "overflow": None if ovh[i] != ovh[i] else int(ovh[i]),
                "aux_loss": aux_s[i] / aux_n[i] if aux_n[i] else None,
                "bias_abs_max": nan(bmh[i]), "top_k": self.top_k,
            })
        self.reset()
        return {"step": int(step), "layers": layers, "maxvio_worst_mean": mean(worst_sum),
                "skipped_steps": int(host[-2]), "nonfinite_steps": int(host[-1])}

    def reset(self) -> None:
        for name, (t, _) in self.interval_tensors().items():
            t.zero_()
        self.step_counts_LE.zero_()

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies (on the CPU) of every running sum: the interval tensors and the step counts. A
        checkpoint that is not on a log step holds part of an interval; without these the first
        routing row after a resume would cover only the steps after it."""
        tensors = {n: t for n, (t, _) in self.interval_tensors().items()}
        tensors["step_counts_LE"] = self.step_counts_LE
        return {n: t.detach().cpu().clone() for n, t in sorted(tensors.items())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict()` returned (this rank's sums); a missing or misshapen entry is a
        ValueError naming it."""
        for name, t in {**{n: t for n, (t, _) in self.interval_tensors().items()},
                        "step_counts_LE": self.step_counts_LE}.items():
            if name not in state and name in MEAN_SUMS:
                continue  # a checkpoint from before the sums: the interval's means cover the steps since
            if name not in state:
                raise ValueError(f"routing accumulator state: no {name!r} entry (has {sorted(state)})")
            if tuple(state[name].shape) != tuple(t.shape):
                raise ValueError(f"routing accumulator state: {name} has shape {tuple(state[name].shape)}, "
                                 f"expected {tuple(t.shape)}")
            t.copy_(state[name])

    def state_for_rank(self, saved: list[dict[str, torch.Tensor]], rank: int, world: int
                       ) -> dict[str, torch.Tensor]:
        """This rank's accumulator state from the states of the `len(saved)` ranks that wrote a
        checkpoint. At the same world size each rank takes its own. At another world size what must
        survive is what `record` computes, the reduction over ranks: rank 0 takes the sum (or max) of
        the saved ranks' sums and every other rank starts from zero, so the next all-reduce ("sum")
        gives the same totals; "max" tensors go to every rank (max is idempotent and the sums start at
        zero, which is below every maxvio); tensors that are not reduced (the per-step counts, zero
        between steps) come from saved rank 0."""
        if not saved:
            raise ValueError("routing accumulator state: no saved ranks")
        if len(saved) == world:
            return saved[rank]
        ops = {n: op for n, (_, op) in self.interval_tensors().items()}
        out: dict[str, torch.Tensor] = {}
        for name, first in saved[0].items():
            rows = torch.stack([s[name] for s in saved])
            op = ops.get(name)
            if op == "sum":
                out[name] = rows.sum(0) if rank == 0 else torch.zeros_like(first)
            elif op == "max":
                out[name] = rows.amax(0)
            else:
                out[name] = first.clone()
        return out

    def all_reduce(self, fn: Callable[[torch.Tensor, str], None]) -> None:
        """Apply `fn(tensor, op)` (op "sum" or "max") to every per-rank interval tensor, in a fixed
        order; the global ones are left alone (class note)."""
        for _, (t, op) in sorted(self.interval_tensors().items()):
            if op != "global":
                fn(t, op)
