"""What both sides of `dropless bench lora` share (bench/lora_side.py builds dropless's and runs the
steps; bench/lora_peft.py builds peft's): the spec, the built side, the batch, the loss and the
file names in the work folder. Apart so that the two sides import it, not each other."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# The nonzero B of the equivalence step: transformers' initializer_range, the std of the checkpoint's
# base weights, so an adapter's output is ~10% of its base projection's at r = 16 (A ~ U(+-1/sqrt(in)),
# scale 2): large enough that a wrongly placed block moves the loss, small enough to stay O(1).
B_STD = 0.02
B_NAMES = ("lora_B", "lora_b1_ErW", "lora_b2_ErD")
PROBE = 16  # positions of the first sequence whose logits the first step compares ([P, V] each side)
ADAPTERS, GRADS, LOGITS = "adapters.pt", "grads.pt", "logits.pt"  # in Spec.work


@dataclass(frozen=True)
class Spec:
    hf_dir: str
    rank: int
    alpha: float
    batch: int
    seq: int
    warmup: int
    steps: int
    threads: int
    lr: float
    seed: int
    dtype: str  # "fp32" | "bf16": the forward's autocast on both sides
    work: str  # the dropless side writes its adapters, first gradients and logits here; peft reads them
    malloc: str = "system"  # "keep": cpu_alloc.keep_freed_memory() first; "system": glibc's defaults

    def path(self, name: str) -> Path:
        return Path(self.work) / name


@dataclass
class Built:
    """What a side hands the step loop: its model's (loss, logits_BSV) on the batch, the trainable
    tensors, facts for the report, the first step's check (given the probed logits_PV, with the
    gradients in place) and a check to run once the figures are taken (None: none)."""
    loss: Callable[[bool], tuple[torch.Tensor, torch.Tensor | None]]  # (want the logits) -> (loss, logits)
    trainable: list[nn.Parameter]
    info: dict
    first_step: Callable[[torch.Tensor], dict]
    check: Callable[[], dict] | None = None


def batch(vocab: int, B: int, S: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_BS, targets_BS): random ids over the whole vocabulary, the targets the next token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.float().reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1))


def autocast(dtype: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if dtype == "fp32" else torch.autocast("cpu", dtype=torch.bfloat16)
