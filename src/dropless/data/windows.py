"""Training and validation windows over token runs: which tokens a micro-batch holds, which document
each token is in, and which targets take loss.

Legend: B batch, S sequence length, N tokens in a run, D documents in a run, W windows.

A run (`TokenRun`) is one contiguous piece of a split: the whole in-memory split, or one shard of a
prepared folder (data/prepared.py, memory-mapped: only the windows drawn are ever read). Its
`starts` say where each document begins; its optional `loss` marks the tokens that may be a target
(chat data: the assistant replies, data/chat.py).

Two ways to draw a window of S + 1 tokens (S inputs, S targets):
- `aligned=False` (text): a random start anywhere in the runs. With one run this is exactly
  batches.get_batch's draw (same generator, same starts), so the default corpus trains as before.
- `aligned=True` (chat examples): a window starts at a document chosen uniformly, and holds it and
  whatever follows it in the run; the run's last window is right-padded (input 0, no loss). Every
  example shorter than the window is seen whole at the start of some window, with its whole prompt.
Both are pure functions of (seed, rank, step, micro-step): no sampler state to save on resume.

With `document_mask`, each row carries `segments_BS` (the document index of each input, from 0 in the
row; padding is a document of its own) for the model's attention mask and positions
(layers/doc_mask.py), and a target in another document than its input takes no loss (IGNORE_INDEX):
the first token of a document cannot be predicted from the one before. With `loss`, a target outside
the marked tokens takes no loss either.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from ..device import to_device
from .batches import batch_seed

__all__ = ["IGNORE_INDEX", "TokenRun", "Window", "Windows"]

from ..layers.doc_mask import IGNORE_INDEX  # a target that takes no loss


@dataclass(frozen=True)
class TokenRun:
    """One contiguous piece of a split (module note)."""

    tokens: np.ndarray  # 1-D ids, any integer dtype; a read-only np.memmap for prepared shards
    starts: np.ndarray  # int64, sorted, starts[0] == 0: each document's first token
    loss: np.ndarray | None = None  # uint8 per token: 1 = may be a target that takes loss
    maps: tuple[tuple[mmap.mmap, int], ...] = ()  # prepared shards: (memory map, item size) of each array

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.starts.ndim != 1:
            raise ValueError(f"TokenRun: tokens and starts must be 1-D, got {self.tokens.shape}, {self.starts.shape}")
        if len(self.tokens) and (len(self.starts) == 0 or self.starts[0] != 0):
            raise ValueError("TokenRun: starts must begin with 0 (the first document's first token)")
        if self.loss is not None and self.loss.shape != self.tokens.shape:
            raise ValueError(f"TokenRun: loss has shape {self.loss.shape}, tokens {self.tokens.shape}")

    def release(self) -> None:
        """Unmap the run's pages from this process (they stay in the page cache; the next read maps them
        again). A fault maps more than the window it serves (fault-around, a large page-cache folio), so
        the whole map is dropped, not the window's range. Without this every page a window once read
        would stay in the resident set, which would grow with the steps and the corpus. No-op for
        in-memory runs."""
        if hasattr(mmap, "MADV_DONTNEED"):
            for mm, _ in self.maps:
                mm.madvise(mmap.MADV_DONTNEED)


@dataclass(frozen=True)
class Window:
    """A micro-batch: inputs, targets (IGNORE_INDEX where no loss) and, with document masking, the
    document index of each input; int64, on the device."""

    x_BS: torch.Tensor
    y_BS: torch.Tensor
    segments_BS: torch.Tensor | None


class Windows:
    """Draws windows of `seq_len` inputs from `runs` (module note)."""

    def __init__(self, runs: list[TokenRun], seq_len: int, *, aligned: bool = False,
                 document_mask: bool = False, loss_masked: bool = False, what: str = "split") -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got seq_len={seq_len}")
        if loss_masked and any(r.loss is None for r in runs):
            raise ValueError(f"the {what} has no loss mask (only chat data has one): use data.loss_on=all")
        self.runs = [r for r in runs if len(r.tokens) > (0 if aligned else seq_len)]
        if not self.runs:
            n = sum(len(r.tokens) for r in runs)
            raise ValueError(f"the {what} has {n} tokens, fewer than train.seq_len + 1 = {seq_len + 1}; "
                             "use a shorter train.seq_len or more data")
        self.seq_len, self.aligned = seq_len, aligned
        self.document_mask, self.loss_masked = document_mask, loss_masked
        # random starts: run r owns [cum[r], cum[r + 1]) of one range; aligned: documents, likewise
        sizes = [len(r.starts) if aligned else len(r.tokens) - seq_len for r in self.runs]
        self.cum = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(r.tokens) for r in self.runs))

    def _place(self, index: int) -> tuple[TokenRun, int]:
        """(run, first token) of the window numbered `index` in the joined range."""
        r = int(np.searchsorted(self.cum, index, side="right")) - 1
        run, local = self.runs[r], index - int(self.cum[r])
        return run, int(run.starts[local]) if self.aligned else local

    def draw(self, step: int, micro_step: int, batch_size: int, seed: int, *, rank: int = 0,
             device: torch.device | str | None = None) -> Window:
        """B random windows: a pure function of (seed, rank, step, micro_step) (batches.batch_seed)."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got batch_size={batch_size}")
        g = torch.Generator().manual_seed(batch_seed(seed, step, micro_step, rank))
        # randint's high is exclusive: a text start is <= N - S - 1, so start + S is in the run
        index_B = torch.randint(0, int(self.cum[-1]), (batch_size,), generator=g).numpy()  # host data
        return self._assemble([self._place(int(i)) for i in index_B], device)

    def evaluation(self, batch_size: int, max_batches: int | None = None, *,
                   device: torch.device | str | None = None) -> Iterator[Window]:
        """Fixed windows spread evenly over the split (batches.eval_batches' choice with one text run):
        non-overlapping ones for text, ones starting at evenly spaced documents when aligned."""
        if max_batches is not None and max_batches <= 0:
            raise ValueError(f"max_batches must be positive or None, got max_batches={max_batches}")
        S = self.seq_len
        # window j of run r: its document j (aligned) or its tokens [j S, (j + 1) S] (text)
        counts = [len(r.starts) if self.aligned else (len(r.tokens) - 1) // S for r in self.runs]
        cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        total = int(cum[-1])
        want = total if max_batches is None else min(total, max_batches * batch_size)
        # evenly spaced distinct windows: floor(i * W / want) is strictly increasing for want <= W
        chosen = []
        for i in np.arange(want, dtype=np.int64) * total // max(want, 1):
            r = int(np.searchsorted(cum, i, side="right")) - 1
            run, j = self.runs[r], int(i - cum[r])
            chosen.append((run, int(run.starts[j]) if self.aligned else j * S))
        for i in range(0, want, batch_size):
            yield self._assemble(chosen[i:i + batch_size], device)

    def _assemble(self, places: list[tuple[TokenRun, int]], device: torch.device | str | None) -> Window:
        S, B = self.seq_len, len(places)
        w_BS1 = np.zeros((B, S + 1), dtype=np.int64)
        keep_BS = np.ones((B, S), dtype=bool)  # targets that take loss
        seg_BS1 = np.zeros((B, S + 1), dtype=np.int64)
        for b, (run, first) in enumerate(places):
            end = min(first + S + 1, len(run.tokens))
            n = end - first
            w_BS1[b, :n] = run.tokens[first:end]
            keep_BS[b, n - 1:] = False  # padding (aligned windows at a run's end)
            if self.document_mask:
                lo = int(np.searchsorted(run.starts, first, side="right")) - 1
                doc_n = np.searchsorted(run.starts, np.arange(first, end), side="right") - 1 - lo
                seg_BS1[b, :n] = doc_n
                seg_BS1[b, n:] = doc_n[-1] + 1  # padding: a document of its own
            if self.loss_masked:
                keep_BS[b, :n - 1] &= run.loss[first + 1:end].astype(bool)
            run.release()
        if self.document_mask:
            keep_BS &= seg_BS1[:, 1:] == seg_BS1[:, :-1]
        y_BS = np.where(keep_BS, w_BS1[:, 1:], IGNORE_INDEX)
        planes = [w_BS1[:, :-1], y_BS] + ([seg_BS1[:, :-1]] if self.document_mask else [])
        stacked = torch.from_numpy(np.ascontiguousarray(np.stack(planes)))
        if device is not None:  # one copy for all planes
            stacked = to_device(stacked, torch.device(device))
        return Window(stacked[0], stacked[1], stacked[2] if self.document_mask else None)
