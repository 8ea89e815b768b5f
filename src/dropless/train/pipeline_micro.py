"""One optimizer step's forward and backward passes under pipeline stages (`parallel.pp_size` > 1): the
same contract as micro_batches.py, through `Pipeline.step` (distributed/pipeline.py).

This rank's share of a step is `train.grad_accum` batches of `train.batch_size` rows (the batches the
data-parallel index draws; every rank of a pipeline draws the same ones), each one schedule call cut
into `parallel.pp_microbatches` micro-batches. The pipeline applies the balancing losses, the
global-batch aux loss from the step's counts and the 1 / micro-batches scale; here each micro-batch's
statistics of this rank's layers go to the routing health, whose step counts (all-reduced over the
stage's data-parallel ranks) drive the bias and quantile rules in `end_step`.

The losses are device scalars of this rank's part: the cross-entropy and the MTP loss on the ranks
of the last stage (zero elsewhere), the balancing loss of this rank's stages (the MTP modules' MoE
blocks' on the last); the trainer's log row sums them over every rank and divides by the
data-parallel size.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..distributed.pipeline import Pipeline
from ..model import ModelOutput
from .data_source import DataSource
from .health import TrainHealth
from .micro_batches import StepLosses


@dataclass
class PipelineMicroBatches:
    pipeline: Pipeline
    grad_accum: int
    data: DataSource
    health: TrainHealth
    autocast: Callable[[], contextlib.AbstractContextManager]
    device: torch.device
    data_s: float = 0.0

    def take_data_ms(self, n_steps: int) -> float:
        """Mean milliseconds per step spent drawing batches since the last call."""
        ms, self.data_s = 1e3 * self.data_s / max(n_steps, 1), 0.0
        return ms

    def run(self, step: int, log_step: bool) -> tuple[StepLosses, torch.Tensor, torch.Tensor]:
        """The step's passes; returns this rank's losses and (no buffered EP under stages) zero overflow."""
        self.health.begin_step(log_step, step)
        t0 = time.perf_counter()
        batches = []
        for micro in range(self.grad_accum):
            b = self.data.batch(step, micro)
            batches.append((b.x_BS, b.y_BS) if b.segments_BS is None else (b.x_BS, b.y_BS, b.segments_BS))
        self.data_s += time.perf_counter() - t0
        with self.autocast():
            out = self.pipeline.step(batches)
        zero = torch.zeros((), device=self.device)
        for records in out.records:
            moe = [m for r in records for m in r.moe]
            mtp_moe = [m for r in records for m in r.mtp_moe]  # the MTP modules' MoE blocks: balanced too
            self.health.add_micro(ModelOutput(None, None, None, zero, moe, mtp_moe=mtp_moe))
        ce = out.ce if out.ce is not None else zero
        weight = self.pipeline.cfg.mtp_weight
        mtp = None if not self.pipeline.cfg.mtp_depth else out.mtp if out.mtp is not None else zero
        loss = ce + out.moe_loss + (weight * mtp if mtp is not None else 0.0)
        losses = StepLosses(loss, ce, out.moe_loss, mtp)
        none = torch.zeros((), dtype=torch.int64, device=self.device)
        return losses, none, none
