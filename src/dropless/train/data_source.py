"""What a run trains and evaluates on: the tokenizer, the train and validation splits, and with
`data.replay_routing` a routing record whose sequences and expert ids replace the train split.

A micro-batch is a pure function of (seed, step, micro-step), so a resumed run sees the same
batches (data/batches.py; a record's own order, data/replay.py). Under W processes, rank r's
micro-batch m is the micro-batch m * W + r that one process with W times the accumulation would
draw: W ranks with grad_accum A follow one process with grad_accum W*A.

The windows come from data/windows.py over the runs data/splits.py reads (the embedded corpus, user
text, chat JSONL or a prepared folder). Chat data is drawn in windows that start at an example, with
document masking and the loss on assistant replies unless the data section says otherwise.

`load_data` runs before the model exists (a bad data path fails before any weights are built);
`with_replay` follows the model, whose expert slots bound a record's ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import RunConfig, TrainConfig
from ..data.replay import ReplayData
from ..data.splits import load_runs, split_windows
from ..data.tokenizer import Tokenizer, load_tokenizer
from ..data.windows import Window, Windows
from ..model import MoEModel
from .layout import Layout



@dataclass(frozen=True)
class Batch:
    x_BS: torch.Tensor
    y_BS: torch.Tensor  # IGNORE_INDEX where a target takes no loss
    replay_ids: list[torch.Tensor] | None = None  # per MoE layer, data.replay_routing
    segments_BS: torch.Tensor | None = None  # each input's document (data.document_mask)

    def model_kwargs(self) -> dict:
        return {"replay_ids": self.replay_ids, "segments_BS": self.segments_BS}


@dataclass
class DataSource:
    train: TrainConfig
    tokenizer: Tokenizer
    train_windows: Windows
    val_windows: Windows
    device: torch.device
    world_size: int
    rank: int
    replay: ReplayData | None = None
    source: str = ""

    def micro_index(self, micro: int) -> int:
        """This rank's micro-batch `micro` is the one-process micro-batch micro * W + rank."""
        return micro * self.world_size + self.rank

    def batch(self, step: int, micro: int) -> Batch:
        """This rank's micro-batch `micro` of `step`."""
        if self.replay is not None:
            return Batch(*self.replay.batch(step, self.micro_index(micro)))
        t = self.train
        w = self.train_windows.draw(step, self.micro_index(micro), t.batch_size, t.seed, device=self.device)
        return Batch(w.x_BS, w.y_BS, None, w.segments_BS)

    def val_batches(self) -> list[Window]:
        """The validation windows of an evaluation (the same every time: data/windows.py)."""
        t = self.train
        return list(self.val_windows.evaluation(t.batch_size, t.eval_batches, device=self.device))

    def probe(self) -> torch.Tensor:
        """The routing monitor's fixed probe batch: the first validation windows' inputs (at most 4)."""
        return next(iter(self.val_windows.evaluation(min(4, self.train.batch_size), 1, device=self.device))).x_BS

    def tokens_per_step(self) -> float:
        """Tokens of one optimizer step over all ranks (a replayed record's mean sequence length)."""
        t = self.train
        seq_tokens = self.replay.tokens_per_sequence() if self.replay is not None else t.seq_len
        return t.batch_size * seq_tokens * t.grad_accum * self.world_size

    def describe(self) -> str:
        def count(n: int) -> str:
            return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"

        return (f"{self.source}: train {count(self.train_windows.num_tokens)} tokens, "
                f"val {count(self.val_windows.num_tokens)}")


def load_data(cfg: RunConfig, layout: Layout) -> DataSource:
    """The tokenizer (checked against `model.vocab_size`) and the encoded splits."""
    d = cfg.data
    tokenizer = load_tokenizer(d.tokenizer, d.tokenizer_path)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: smaller than the tokenizer's "
                         f"vocabulary ({tokenizer.vocab_size})")
    splits = load_runs(d, tokenizer, cfg.train.seq_len)
    train, val = split_windows(d, splits, cfg.train.seq_len)
    return DataSource(cfg.train, tokenizer, train, val, layout.device, layout.dp_world, layout.dp_rank,
                      source=splits.source)


def with_replay(data: DataSource, cfg: RunConfig, model: MoEModel) -> DataSource:
    """`data` with `data.replay_routing`'s record as the train batches (unchanged without one)."""
    if not cfg.data.replay_routing:
        return data
    replay = ReplayData(cfg.data.replay_routing, cfg, model.expert_slots(), data.device,
                        cfg.train.grad_accum * data.world_size)
    return dataclasses.replace(data, replay=replay)
