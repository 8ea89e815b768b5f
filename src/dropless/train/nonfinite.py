"""Non-finite steps: skipped on the device, counted, and the run stopped after too many in a row.

A step whose loss or gradient norm is NaN or Inf would write NaN into every parameter (the norm clip
multiplies every gradient by max_norm / NaN) and into AdamW's moments, and the run would be lost from
there on. The guard makes such a step a no-op, without a host sync per step:

- Flag: `bad = !isfinite(loss) | !isfinite(grad_norm)`, a device bool. A NaN anywhere in a gradient
  makes the global norm NaN and an Inf makes it Inf, so the norm covers every gradient element; the
  loss covers a forward that went bad where the gradient did not (a masked branch). The norm is
  global (every rank computes it over all shards) but the loss is this rank's, so under several
  processes the flag is max-reduced over the data-parallel group (one scalar): every rank skips the
  same steps, as it must (the next forward gathers parameters across ranks).
- Skip: the optimizer skips on the device (`optim.step_unless`: torch's fused AdamW and AdamWBF16
  honour `found_inf`, GradScaler's mechanism): parameters, moments and the step count stay
  bit-identical, at no memory cost (a copy of parameters and state restored with `where`, as
  buffered EP once did, costs one more copy of the whole training state). The router buffers (expert
  bias, thresholds) take the same flag (TrainHealth.end_step), and the step's routing statistics are
  left out of the routing record, which counts the step under `nonfinite_steps` instead.
- Count: device counters of flagged steps since the last read, the current streak, and the longest
  streak since the last read.
- Check: the host reads them (one sync of three scalars) at log steps and before each checkpoint.
  When a streak reached `train.max_nonfinite_steps` the run stops with `NonFiniteError` before it
  writes another checkpoint. Every checkpoint holds a finite state anyway (a skipped step changes
  nothing), so the last one is good; stopping only ends a run that keeps failing. A shorter streak is
  counted and reported, and the run goes on with the next batches.

Why 5 by default: the weights do not move during a streak, but every step draws new batches, so a
streak of 5 means five different batches failed on the same weights. One bad batch (a corrupt
document, a rare spike in one expert) is skipped and forgotten; a state that fails on whatever it is
fed (bf16 overflow in a layer, a learning rate that already broke the optimizer's assumptions) fails
5 in a row and stops after 5 wasted steps (plus up to `log.log_every` - 1 until the next read: the
check rides on the host reads the trainer already makes).
"""

from __future__ import annotations

import torch

from .layout import AllReduce


class NonFiniteError(FloatingPointError):
    """Too many consecutive steps with a non-finite loss or gradient norm: the run stops."""


class NonFiniteGuard:
    def __init__(self, max_streak: int, reduce: AllReduce | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.max_streak, self.reduce = max_streak, reduce
        z = lambda: torch.zeros((), dtype=torch.int64, device=device)  # noqa: E731
        self.count, self.streak, self.worst = z(), z(), z()  # since the last read / now / since the last read
        self.pending = 0  # host: flagged steps read but not yet reported in a log row
        self.total = 0  # host: flagged steps of the run (this process's lifetime)
        self.last_worst = 0  # host: the longest streak at the last read
        self.last_streak = 0  # host: the streak running at the last read

    def flag(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """The device bool `bad` for this step (agreed over ranks); updates the counters."""
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if self.reduce is not None:
            flag = bad.to(torch.int64)
            self.reduce(flag, "max")
            bad = flag > 0
        self.count += bad.long()
        self.streak.mul_(bad).add_(bad)  # streak + 1 where bad, else 0
        self.worst = torch.maximum(self.worst, self.streak)
        return bad

    def read(self) -> None:
        """One host sync: move the device counters to the host."""
        count, streak, worst = torch.stack([self.count, self.streak, self.worst]).tolist()
        self.pending += count
        self.total += count
        self.last_worst, self.last_streak = worst, streak
        self.count.zero_()
        self.worst.fill_(streak)  # a streak still running carries over into the next read

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps (after `read`, which every save follows): the streak running
        across it, so a resumed run stops where the uninterrupted one would, and the flagged steps
        not yet in a log row, so they still reach metrics.jsonl."""
        return {"streak": self.last_streak, "pending": self.pending}

    def load_state_dict(self, state: dict[str, int]) -> None:
        streak = int(state.get("streak", 0))
        self.streak.fill_(streak)
        self.worst.fill_(streak)
        self.last_streak = streak
        self.pending = int(state.get("pending", 0))

    def take(self) -> int:
        """Flagged steps since the last log row (after `read`); resets the count."""
        n, self.pending = self.pending, 0
        return n

    def stop_if_stuck(self, step: int) -> None:
        """Raise `NonFiniteError` when a streak reached the limit (as of the last `read`)."""
        if self.last_worst >= self.max_streak:
            raise NonFiniteError(
                f"{self.last_worst} consecutive optimizer steps (seen at step {step}) had a non-finite loss "
                f"or gradient norm (train.max_nonfinite_steps={self.max_streak}; {self.total} such steps "
                "in this run): they were skipped, parameters, optimizer state and router buffers are "
                "unchanged, and the last checkpoint holds a finite state. Likely: a learning rate too "
                "high (lower train.lr or lengthen train.warmup_steps), bf16 overflow in a layer "
                "(train.dtype=fp32, moe.act_clamp), or bad data; `dropless diagnose` on the run shows "
                "the routing before it.")
