"""Learning-rate schedules as one pure function of the step.

Design notes
- `lr_at(step, ...)` has no state, so a resumed run gets the right rate from the step alone and a
  schedule can be plotted or tested without an optimizer. The trainer writes the value into each
  param group (times a per-group multiplier if it has one).
- Steps are 0-based and a run executes steps 0 .. total_steps - 1. Warm-up is linear,
  base_lr * (step + 1) / warmup_steps, so step 0 already trains (a zero first step wastes a batch)
  and step warmup_steps - 1 is at base_lr. Every decay ends exactly at min_lr = min_lr_ratio *
  base_lr on the last step, total_steps - 1, and holds there for any step beyond.
- kinds:
  * "cosine": half-cosine from base_lr at step warmup_steps to min_lr at the last step.
  * "wsd" (warmup-stable-decay, MiniCPM / "Scaling Laws and Compute-Optimal Training Beyond Fixed
    Training Durations"): hold base_lr, then decay linearly to min_lr over the last
    decay_fraction * total_steps steps (never starting before warm-up ends). The stable phase is
    what makes WSD runs extendable: a checkpoint from the plateau can be decayed at any length.
  * "constant": warm-up, then base_lr.
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULE_KINDS", "lr_at"]

SCHEDULE_KINDS = ("cosine", "wsd", "constant")


def _progress(step: int, start: int, end: int) -> float:
    """0 at or before `start`, 1 at or after `end`, linear in between."""
    if step <= start:
        return 0.0 if step < end else 1.0
    if step >= end:
        return 1.0
    return (step - start) / (end - start)


def _validate(
    step: int, base_lr: float, warmup_steps: int, total_steps: int, kind: str,
    min_lr_ratio: float, decay_fraction: float,
) -> None:
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"lr schedule: unknown kind={kind!r}; expected one of {SCHEDULE_KINDS}")
    if step < 0:
        raise ValueError(f"lr schedule: step must be >= 0, got step={step}")
    if base_lr < 0:
        raise ValueError(f"lr schedule: base_lr must be >= 0, got base_lr={base_lr}")
    if total_steps < 1:
        raise ValueError(f"lr schedule: total_steps must be >= 1, got total_steps={total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"lr schedule: warmup_steps must be in [0, total_steps={total_steps}], "
            f"got warmup_steps={warmup_steps}"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"lr schedule: min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if not 0.0 <= decay_fraction <= 1.0:
        raise ValueError(f"lr schedule: decay_fraction must be in [0, 1], got {decay_fraction}")


def lr_at(
    step: int,
    *,
    base_lr: float,
    warmup_steps: int,
    total_steps: int,
    kind: str = "cosine",
    min_lr_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> float:
    """The learning rate at 0-based `step`; `decay_fraction` is used by "wsd" only."""
    _validate(step, base_lr, warmup_steps, total_steps, kind, min_lr_ratio, decay_fraction)
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if kind == "constant":
        return base_lr
    min_lr = base_lr * min_lr_ratio
    last = total_steps - 1
    if kind == "cosine":
        p = _progress(step, warmup_steps, last)
        return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    # wsd
    decay_steps = round(decay_fraction * total_steps)
    if decay_steps == 0:
        return base_lr
    # decay_steps steps below base_lr, the last of them (step total_steps - 1) exactly at min_lr.
    decay_start = max(warmup_steps, last - decay_steps)
    p = _progress(step, decay_start, last)
    return base_lr - (base_lr - min_lr) * p
