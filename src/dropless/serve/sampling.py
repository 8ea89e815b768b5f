"""Next-token sampling: repetition penalty, temperature, top-k, top-p, on a batch of logits.

Legend: B sequences, V vocabulary.

Order of operations (the common one, as in HF transformers' logits processors): repetition penalty
on the raw logits, then greedy argmax (temperature 0) or division by the temperature, top-k, top-p,
and one draw per sequence from the softmax with the caller's generator. Everything stays on the
device: no host read, so a decode loop that does not stream never waits for the GPU here.

- repetition penalty p (CTRL, Keskar et al. 2019): every token already in the sequence (prompt or
  generated) has its logit divided by p when positive and multiplied by p when negative, so p > 1
  always makes a seen token less likely; p = 1 is off.
- top-k: keeps the k largest logits (ties with the k-th are kept too).
- top-p (nucleus): keeps the smallest set of most likely tokens whose probability mass is >= p (a
  token is kept when the mass of the tokens ranked above it is < p; the most likely is always kept);
  p = 1 keeps all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        # messages name the Python field and the CLI flag: both reach users
        t, k, p, r = self.temperature, self.top_k, self.top_p, self.repetition_penalty
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature={t!r} (--temperature): must be a finite number >= 0")
        if k is not None and not (isinstance(k, int) and k >= 1):
            raise ValueError(f"top_k={k!r} (--top-k): must be an integer >= 1")
        if p is not None and not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise ValueError(f"top_p={p!r} (--top-p): must be in (0, 1]")
        if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
            raise ValueError(f"repetition_penalty={r!r} (--repetition-penalty): must be a finite number > 0")


def apply_repetition_penalty(logits_BV: torch.Tensor, seen_BV: torch.Tensor, penalty: float) -> torch.Tensor:
    if penalty == 1.0:
        return logits_BV
    penalized = torch.where(logits_BV > 0, logits_BV / penalty, logits_BV * penalty)
    return torch.where(seen_BV, penalized, logits_BV)


def filter_top_k(logits_BV: torch.Tensor, k: int) -> torch.Tensor:
    kth_B1 = logits_BV.topk(min(k, logits_BV.shape[-1]), dim=-1).values[:, -1:]
    return logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))


def filter_top_p(logits_BV: torch.Tensor, p: float) -> torch.Tensor:
    sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
    probs_BV = torch.softmax(sorted_BV, dim=-1)
    mass_before_BV = probs_BV.cumsum(-1) - probs_BV
    drop_sorted_BV = mass_before_BV >= p
    drop_sorted_BV[:, 0] = False  # the most likely token stays whatever rounding did
    drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
    return logits_BV.masked_fill(drop_BV, float("-inf"))


def sample_next(logits_BV: torch.Tensor, seen_BV: torch.Tensor, s: Sampling,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each sequence, int64 [B], on the logits' device."""
    logits = apply_repetition_penalty(logits_BV.float(), seen_BV, s.repetition_penalty)
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k is not None:
        logits = filter_top_k(logits, s.top_k)
    if s.top_p is not None and s.top_p < 1:
        logits = filter_top_p(logits, s.top_p)
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)
