"""Validation loss of a loaded model on its run's validation split, the way the trainer measures it
(`Trainer.evaluate`: the same fixed windows, the mean cross-entropy per token in nats; with the byte
tokenizer, nats per byte), on one process.

`dtype` is the autocast dtype of the forward ("fp32": none); the router stays fp32 either way.
"""

from __future__ import annotations

import contextlib

import torch

from ..config import RunConfig
from ..model import MoEModel
from ..data.batches import eval_batches, load_splits
from ..data.tokenizer import load_tokenizer

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def val_tokens(cfg: RunConfig) -> torch.Tensor:
    """The run's validation split, tokenized as the trainer did."""
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    return load_splits(cfg.data.sources or None, tok, val_fraction=cfg.data.val_fraction,
                       max_bytes=cfg.data.max_bytes or None, text_field=cfg.data.text_field)[1]


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
    if DTYPES[dtype] is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


@torch.no_grad()
def val_loss(model: MoEModel, cfg: RunConfig, tokens: torch.Tensor | None = None, dtype: str = "fp32",
             max_batches: int | None = None) -> float:
    """Mean cross-entropy per token over the run's validation windows (`train.eval_batches` batches
    unless `max_batches`), as `Trainer.evaluate` computes it."""
    t = cfg.train
    device = model.embed.weight.device
    tokens = val_tokens(cfg) if tokens is None else tokens
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in eval_batches(tokens, t.batch_size, t.seq_len, max_batches or t.eval_batches,
                             device=device):
        with autocast(device, dtype):
            out = model(x, y)
        sums[0] += out.ce_loss.double() * x.numel()
        sums[1] += x.numel()
    model.train(was_training)
    total, n = sums.tolist()
    return total / max(n, 1)
