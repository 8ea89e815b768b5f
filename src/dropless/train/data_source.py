"""What a run trains and evaluates on: the tokenizer, the train and validation splits, and with
`data.replay_routing` a routing record whose sequences and expert ids replace the train split.

A micro-batch is a pure function of (seed, step, micro-step), so a resumed run sees the same
batches (data/batches.py; a record's own order, data/replay.py). Under W processes, rank r's
micro-batch m is the micro-batch m * W + r that one process with W times the accumulation would
draw: W ranks with grad_accum A follow one process with grad_accum W*A.

`load_data` runs before the model exists (a bad data path fails before any weights are built);
`with_replay` follows the model, whose expert slots bound a record's ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import RunConfig, TrainConfig
from ..data.batches import eval_batches, get_batch, load_splits
from ..data.replay import ReplayData
from ..data.tokenizer import Tokenizer, load_tokenizer
from ..model import MoEModel
from .layout import Layout

Batch = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]  # x_BS, y_BS, replayed ids


@dataclass
class DataSource:
    train: TrainConfig
    tokenizer: Tokenizer
    train_tokens: torch.Tensor
    val_tokens: torch.Tensor
    device: torch.device
    world_size: int
    rank: int
    replay: ReplayData | None = None

    def micro_index(self, micro: int) -> int:
        """This rank's micro-batch `micro` is the one-process micro-batch micro * W + rank."""
        return micro * self.world_size + self.rank

    def batch(self, step: int, micro: int) -> Batch:
        """(inputs, targets, replayed ids per MoE layer or None) of this rank's micro-batch."""
        if self.replay is not None:
            return self.replay.batch(step, self.micro_index(micro))
        t = self.train
        x, y = get_batch(self.train_tokens, step, self.micro_index(micro), t.batch_size, t.seq_len,
                         t.seed, device=self.device)
        return x, y, None

    def val_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The validation windows of an evaluation (the same every time: data/batches.py)."""
        t = self.train
        return list(eval_batches(self.val_tokens, t.batch_size, t.seq_len, t.eval_batches, device=self.device))

    def probe(self) -> torch.Tensor:
        """The routing monitor's fixed probe batch: the first validation windows (at most 4)."""
        t = self.train
        return next(iter(eval_batches(self.val_tokens, min(4, t.batch_size), t.seq_len, 1,
                                      device=self.device)))[0]

    def tokens_per_step(self) -> float:
        """Tokens of one optimizer step over all ranks (a replayed record's mean sequence length)."""
        t = self.train
        seq_tokens = self.replay.tokens_per_sequence() if self.replay is not None else t.seq_len
        return t.batch_size * seq_tokens * t.grad_accum * self.world_size

    def describe(self) -> str:
        return (f"train {self.train_tokens.numel() / 1e6:.1f}M tokens, "
                f"val {self.val_tokens.numel() / 1e6:.2f}M")


def load_data(cfg: RunConfig, layout: Layout) -> DataSource:
    """The tokenizer (checked against `model.vocab_size`) and the encoded splits."""
    d = cfg.data
    tokenizer = load_tokenizer(d.tokenizer, d.tokenizer_path)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: smaller than the tokenizer's "
                         f"vocabulary ({tokenizer.vocab_size})")
    train_tokens, val_tokens = load_splits(d.sources or None, tokenizer, val_fraction=d.val_fraction,
                                           max_bytes=d.max_bytes or None, text_field=d.text_field)
    return DataSource(cfg.train, tokenizer, train_tokens, val_tokens, layout.device, layout.world_size,
                      layout.rank)


def with_replay(data: DataSource, cfg: RunConfig, model: MoEModel) -> DataSource:
    """`data` with `data.replay_routing`'s record as the train batches (unchanged without one)."""
    if not cfg.data.replay_routing:
        return data
    replay = ReplayData(cfg.data.replay_routing, cfg, model.expert_slots(), data.device,
                        cfg.train.grad_accum * data.world_size)
    return dataclasses.replace(data, replay=replay)
