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
from ..data.splits import load_runs, split_windows
from ..data.tokenizer import load_tokenizer
from ..data.windows import IGNORE_INDEX, Windows

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def val_windows(cfg: RunConfig, seq_len: int | None = None) -> Windows:
    """The run's validation windows (of `seq_len` tokens, else train.seq_len), read, masked and
    drawn as the trainer does (data/splits.py)."""
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    S = seq_len or cfg.train.seq_len
    return split_windows(cfg.data, load_runs(cfg.data, tok, S), S)[1]


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
    if DTYPES[dtype] is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


@torch.no_grad()
def val_loss(model: MoEModel, cfg: RunConfig, windows: Windows | None = None, dtype: str = "fp32",
             max_batches: int | None = None) -> float:
    """Mean cross-entropy per target that takes loss over the run's validation windows
    (`train.eval_batches` batches unless `max_batches`), as `Trainer.evaluate` computes it."""
    t = cfg.train
    device = model.embed.weight.device
    windows = val_windows(cfg) if windows is None else windows
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for w in windows.evaluation(t.batch_size, max_batches or t.eval_batches, device=device):
        with autocast(device, dtype):
            out = model(w.x_BS, w.y_BS, segments_BS=w.segments_BS)
        n = (w.y_BS != IGNORE_INDEX).sum().double()
        sums[0] += out.ce_loss.double() * n
        sums[1] += n
    model.train(was_training)
    total, n = sums.tolist()
    return total / max(n, 1)
