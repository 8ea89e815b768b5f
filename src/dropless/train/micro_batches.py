"""One optimizer step's forward and backward passes: `grad_accum` micro-batches, each forward under
the placement's autocast (fp32 master weights; a LoRA run's frozen base is held narrower, and its
forward returns the loss only, `loss_only`), the backward of loss / grad_accum.

The losses stay on the device (means over the micro-batches, read by the host on log steps only).
With `model.moe.balance.global_aux_loss_coeff` the global-batch aux loss needs the counts of the
whole step (all micro-batches, all ranks) before any backward: with one micro-batch they come from
the forward itself; with several, a no-grad forward pre-pass computes them, one extra forward per
step, the price of an exact global loss under accumulation (layers/balance.py).

Every micro-batch's statistics go to the routing health (health.py), the hot-expert replicas'
counts (ep_replicas_train.py) and buffered EP's overflow guard (overflow.py), which also gets the
step's dropped pairs and busiest link demand from here.

Legend: L MoE layers, E selectable experts.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import RunConfig
from ..model import ModelOutput, MoEModel
from .data_source import Batch, DataSource
from .ep_replicas_train import HotReplicas
from .health import TrainHealth, global_aux_terms
from .layout import Layout
from .overflow import OverflowGuard


@dataclass
class StepLosses:
    """Device-side means over one optimizer step's micro-batches."""

    loss: torch.Tensor
    ce: torch.Tensor
    moe: torch.Tensor
    mtp: torch.Tensor | None = None  # model.mtp_depth > 0: the MTP modules' mean loss (layers/mtp.py)


@dataclass
class MicroBatches:
    cfg: RunConfig
    model: MoEModel
    data: DataSource
    health: TrainHealth
    autocast: Callable[[], contextlib.AbstractContextManager]
    device: torch.device
    world_size: int
    replicas: HotReplicas | None = None
    overflow: OverflowGuard | None = None
    data_s: float = 0.0  # host seconds spent drawing micro-batches since the last log row

    @property
    def loss_only(self) -> bool:
        """The forward's `loss_only` (model.py): on in a LoRA run (train.lora)."""
        return self.cfg.train.lora.enabled

    def _batch(self, step: int, micro: int) -> Batch:
        t0 = time.perf_counter()  # the draw is host work (a CPU copy, then an async move): no sync
        b = self.data.batch(step, micro)
        self.data_s += time.perf_counter() - t0
        return b

    def take_data_ms(self, n_steps: int) -> float:
        """Mean milliseconds per step spent drawing batches since the last call."""
        ms, self.data_s = 1e3 * self.data_s / max(n_steps, 1), 0.0
        return ms

    def run(self, step: int, log_step: bool) -> tuple[StepLosses, torch.Tensor, torch.Tensor]:
        """The step's micro-batches, forward and backward; returns the mean losses and this rank's
        EP overflow (dropped pairs, busiest link demand), device scalars."""
        A = self.cfg.train.grad_accum
        pre_counts_LE = self._global_counts(step)
        self.health.begin_step(log_step, step)
        zero = lambda dtype=torch.float32: torch.zeros((), dtype=dtype, device=self.device)  # noqa: E731
        sums = StepLosses(zero(), zero(), zero(), zero() if self.cfg.model.mtp_depth else None)
        dropped, demand = zero(torch.int64), zero(torch.int64)
        for micro in range(A):
            b = self._batch(step, micro)
            with self.autocast():
                # a LoRA run (frozen head, a big model): the loss in chunks, no whole logits (ops/head_loss.py)
                out = self.model(b.x_BS, b.y_BS, **b.model_kwargs(), loss_only=self.loss_only)
            loss, moe_loss = self._with_global_aux(out, pre_counts_LE, b.x_BS.numel())
            (loss / A).backward()
            self.health.add_micro(out)
            if self.replicas is not None:
                self.replicas.observe(out.stats)
            if self.overflow is not None:
                self.overflow.observe(out.all_stats)  # the MTP modules' MoE blocks too
                d, m = OverflowGuard.count(out.all_stats)
                dropped, demand = dropped + d, torch.maximum(demand, m)
            sums.loss += loss.detach().float() / A
            sums.ce += out.ce_loss.detach().float() / A
            sums.moe += moe_loss.detach().float() / A
            if sums.mtp is not None:
                sums.mtp += out.mtp_loss.detach().float() / A
        return sums, dropped, demand

    def _with_global_aux(self, out: ModelOutput, pre_counts_LE: torch.Tensor | None,
                         num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, moe_loss) of a micro-batch, with the global-batch aux loss added when it is on."""
        loss, moe_loss = out.loss, out.moe_loss
        coeff = self.cfg.model.moe.balance.global_aux_loss_coeff
        if coeff > 0 and out.moe:
            counts_LE = pre_counts_LE
            if counts_LE is None:
                counts_LE = torch.stack([s.tokens_per_expert_E.float() for s in out.stats])
                self.health.reduce(counts_LE, "sum")
            extra = coeff * global_aux_terms(out, counts_LE, self.cfg.model.moe.top_k, num_tokens=num_tokens,
                                             num_terms=self.cfg.train.grad_accum * self.world_size)
            loss, moe_loss = loss + extra, moe_loss + extra
        return loss, moe_loss

    def _global_counts(self, step: int) -> torch.Tensor | None:
        """The whole step's counts from a no-grad pre-pass (module note); None when the forward's own
        counts serve (one micro-batch) or the global aux loss is off."""
        A = self.cfg.train.grad_accum
        if self.cfg.model.moe.balance.global_aux_loss_coeff == 0 or A == 1:
            return None
        L, E = len(self.model.moe_layers()), self.model.expert_slots().selectable  # identity experts too
        counts_LE = torch.zeros(L, E, device=self.device)
        with torch.no_grad():
            for micro in range(A):
                b = self._batch(step, micro)
                with self.autocast():
                    out = self.model(b.x_BS, **b.model_kwargs())
                counts_LE += torch.stack([s.tokens_per_expert_E.float() for s in out.stats])
        self.health.reduce(counts_LE, "sum")
        return counts_LE


def build_micro_batches(cfg: RunConfig, model: MoEModel, data: DataSource, layout: Layout,
                        health: TrainHealth, overflow: OverflowGuard | None) -> MicroBatches:
    return MicroBatches(cfg, model, data, health, layout.placement.autocast, layout.device,
                        layout.dp_world, layout.replicas, overflow)
