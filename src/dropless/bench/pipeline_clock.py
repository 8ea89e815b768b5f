"""The clock `dropless bench pipeline` puts on one rank's `Pipeline`: how much of each optimizer step
the rank spends computing its own stages, and how much waiting for the others (the bubble).

Compute is what torch.distributed.pipelining runs for one micro-batch of one stage:
`PipelineStage.forward_one_chunk`, `backward_one_chunk` (the whole backward, or its input half under
the zero-bubble schedules) and `backward_weight_one_chunk` (their weight half), plus the loss on the
last stage (the schedule's `loss_fn`: the head's cross-entropy, called between a forward and the
schedule's sends). torch's schedules (2.13, pinned) wait for a micro-batch's received activations or
gradients before they call these and post their sends after, so the time inside them is the stage's
own work. The wall is the time inside the training schedule's `step` calls (the global aux loss's
forward-only pre-pass runs another schedule, on other `PipelineStage` objects, and is not counted).
A step's bubble on this rank is 1 - compute / wall: waits for other stages, plus the schedule's own
bookkeeping (splitting the batch into micro-batches, posting sends and receives).

Two clocks are read around each compute call: the wall clock and this thread's CPU time
(`time.thread_time`). With one torch thread per rank every op of a stage's forward and backward runs
on the calling thread (CPU autograd runs on the thread that calls backward), so CPU time below wall
time means the rank was descheduled while it computed: more busy ranks than cores. Their ratio is
reported as `compute_cpu_frac` (1.0 when every rank had a core to itself).

The wrappers are instance attributes on this pipeline's own stage and schedule objects (the bench's
trainers only); they count nested calls once.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from torch.distributed.pipelining import schedules as pp_schedules

from ..distributed.pipeline import Pipeline

COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def schedule_stages(schedule: pp_schedules._PipelineSchedule) -> list:
    """The `PipelineStage`s a torch schedule runs on this rank (one for gpipe and 1f1b, a list for the
    looped schedules; private attributes of torch's schedules, pinned)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


@dataclass
class StepReading:
    """One optimizer step on this rank, in seconds."""

    wall_s: float  # inside the training schedule's step calls
    compute_s: float  # wall clock inside the stages' compute calls
    compute_cpu_s: float  # this thread's CPU time inside them

    @property
    def bubble(self) -> float:
        return 1.0 - self.compute_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class StageClock:
    """Wraps `pipeline`'s training schedule and its stages (module note); `start()` before and
    `stop()` after each optimizer step record one `StepReading`."""

    pipeline: Pipeline
    readings: list[StepReading] = field(default_factory=list)
    _wall: float = 0.0
    _compute: float = 0.0
    _cpu: float = 0.0
    _depth: int = 0

    def __post_init__(self) -> None:
        schedule = self.pipeline.schedule
        for stage in schedule_stages(schedule):
            for name in COMPUTE:
                setattr(stage, name, self._timed(getattr(stage, name), compute=True))
        if schedule._loss_fn is not None:  # (called by the schedule as self._loss_fn(output, target))
            schedule._loss_fn = self._timed(schedule._loss_fn, compute=True)
        schedule.step = self._timed(schedule.step, compute=False)

    def _timed(self, fn: Callable, compute: bool) -> Callable:
        def timed(*args, **kwargs):
            if compute and self._depth:  # inside another compute call: counted there
                return fn(*args, **kwargs)
            if compute:
                self._depth += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                if compute:
                    self._depth -= 1
                    self._compute += dt
                    self._cpu += time.thread_time() - c0
                else:
                    self._wall += dt
        return timed

    def start(self) -> None:
        self._wall = self._compute = self._cpu = 0.0

    def stop(self) -> None:
        self.readings.append(StepReading(self._wall, self._compute, self._cpu))

    def summary(self, skip: int) -> dict[str, float]:
        """Medians over the readings after the first `skip` (warm-up): the bubble, the schedule's wall
        ms; and the CPU share of the compute over all of them (sums: short calls weigh less)."""
        kept = self.readings[skip:]
        if not kept:
            raise ValueError("no step was timed (--steps must be >= 1)")
        compute = sum(r.compute_s for r in kept)
        return {"bubble": statistics.median(r.bubble for r in kept),
                "sched_ms": 1e3 * statistics.median(r.wall_s for r in kept),
                "compute_ms": 1e3 * statistics.median(r.compute_s for r in kept),
                "compute_cpu_frac": sum(r.compute_cpu_s for r in kept) / compute if compute > 0 else 1.0}
