"""Token streams and batches: encode a corpus once, then sample windows statelessly.

Legend: B = batch size, S = sequence length, N = tokens in a split.

Design notes
- Each split is one 1-D token tensor `tokens_N`, documents joined by `SEPARATOR` (b"\\n\\n", a
  paragraph break that every tokenizer can represent). It is uint8 when the vocabulary fits in a
  byte (the default byte tokenizer: the 12 MB stdlib corpus is 12 MB in memory) and int32 otherwise;
  batches are cast to int64 only when drawn.
- Fast path: with `ByteTokenizer` the bytes already are the ids, so the split is `torch.frombuffer`
  over the joined bytes: no Python list of ints, no per-document encode, no cache file.
  `encode_documents_reference` is the plain per-document path it must equal (tested on UTF-8 text;
  on invalid UTF-8 the fast path keeps the raw bytes, the reference path sees U+FFFD).
- No data-loader state. `get_batch` draws B random windows from a `torch.Generator` seeded from
  sha256(seed, rank, step, micro_step), so the batch is a pure function of those numbers: resuming
  at step N, changing the number of workers or re-running an ablation reproduces the exact batches
  without checkpointing any sampler. Windows may overlap and cross document boundaries, the usual
  trade for a stateless sampler (nanoGPT does the same). `rank` (keyword-only) gives each
  data-parallel rank its own draws.
- `eval_batches` uses fixed non-overlapping windows spread evenly over the split, so a
  `max_batches` budget still sees the whole validation set rather than its first files.
- The splits stay in host memory (a corpus can be larger than a GPU); a batch is drawn there and
  then moved to `device` (through pinned memory, asynchronously, on CUDA: device.py). The draw
  uses a CPU generator whatever the device, so every device sees the same batches.
- If the by-document split leaves a side empty (one input file, or a handful of documents), the
  split falls back to the token stream: the last `val_fraction` of all tokens is validation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from .corpus import Document, read_documents, split_documents, stdlib_documents
from ..device import to_device
from .tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "SEPARATOR",
    "token_dtype",
    "encode_documents",
    "encode_documents_reference",
    "load_splits",
    "batch_seed",
    "get_batch",
    "eval_batches",
]

SEPARATOR = b"\n\n"


def token_dtype(vocab_size: int) -> torch.dtype:
    """Smallest dtype we store token ids in: uint8 for byte vocabularies, int32 otherwise."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got vocab_size={vocab_size}")
    if vocab_size <= 256:
        return torch.uint8
    if vocab_size <= 2**31:
        return torch.int32
    raise ValueError(f"vocab_size={vocab_size} does not fit in int32 token storage")


def encode_documents_reference(
    docs: Sequence[Document], tokenizer: Tokenizer, *, separator: bytes = SEPARATOR
) -> torch.Tensor:
    """Plain path: decode each document, `tokenizer.encode` it, join with the encoded separator."""
    sep_ids = tokenizer.encode(separator.decode("utf-8"))
    ids: list[int] = []
    for i, d in enumerate(docs):
        if i:
            ids.extend(sep_ids)
        ids.extend(tokenizer.encode(d.data.decode("utf-8", errors="replace")))
    return torch.tensor(ids, dtype=token_dtype(tokenizer.vocab_size))


def encode_documents(
    docs: Sequence[Document], tokenizer: Tokenizer, *, separator: bytes = SEPARATOR
) -> torch.Tensor:
    """One 1-D token tensor (tokens_N) for `docs`; bytes -> torch.frombuffer for ByteTokenizer."""
    if isinstance(tokenizer, ByteTokenizer):
        joined = bytearray(separator.join(d.data for d in docs))  # writable, so frombuffer is safe
        if not joined:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(joined, dtype=torch.uint8)
    return encode_documents_reference(docs, tokenizer, separator=separator)


def load_splits(
    sources: Sequence[str | Path] | None,
    tokenizer: Tokenizer,
    *,
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    text_field: str = "text",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train_N, val_N) token tensors; `sources=None` (or empty) means the stdlib corpus."""
    if sources:
        docs = read_documents(sources, text_field=text_field, max_bytes=max_bytes)
    else:
        docs = stdlib_documents(max_bytes=max_bytes)
    train_docs, val_docs = split_documents(docs, val_fraction)
    if val_fraction > 0 and (not train_docs or not val_docs):
        tokens_N = encode_documents(docs, tokenizer)
        cut = len(tokens_N) - max(1, int(len(tokens_N) * val_fraction))
        return tokens_N[:cut], tokens_N[cut:]
    return encode_documents(train_docs, tokenizer), encode_documents(val_docs, tokenizer)


def _check_window(tokens: torch.Tensor, batch_size: int, seq_len: int) -> None:
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got batch_size={batch_size}")
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got seq_len={seq_len}")
    if tokens.numel() < seq_len + 1:
        raise ValueError(
            f"split has {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            f"use a shorter seq_len or more data"
        )


def _windows(
    tokens_N: torch.Tensor, starts_B: torch.Tensor, seq_len: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    dev = tokens_N.device
    # S+1 consecutive tokens give S (input, target) pairs.
    idx_BS1 = starts_B.to(dev)[:, None] + torch.arange(seq_len + 1, device=dev)
    w_BS1 = tokens_N[idx_BS1].long()
    if device is not None:  # one copy for inputs and targets, which are views of it
        w_BS1 = to_device(w_BS1, torch.device(device))
    return w_BS1[:, :-1], w_BS1[:, 1:]


def batch_seed(seed: int, step: int, micro_step: int, rank: int = 0) -> int:
    """The generator seed for one micro-batch: a stable hash, so nearby steps are uncorrelated."""
    digest = hashlib.sha256(f"{seed}:{rank}:{step}:{micro_step}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # 63 bits: manual_seed takes a signed int64


def get_batch(
    tokens: torch.Tensor,
    step: int,
    micro_step: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    *,
    rank: int = 0,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_BS, y_BS) int64 on `device` (None: where `tokens` is): B random windows, y is x shifted
    left by one token."""
    _check_window(tokens, batch_size, seq_len)
    g = torch.Generator().manual_seed(batch_seed(seed, step, micro_step, rank))
    # randint's high is exclusive: start <= N - S - 1, so start + S (the last target) is in range.
    starts_B = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=g)
    return _windows(tokens, starts_B, seq_len, device)


def eval_batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, max_batches: int | None = None,
    *, device: torch.device | str | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic (x_BS, y_BS) over fixed non-overlapping windows; the last batch may be short.

    With `max_batches`, min(all windows, max_batches * B) windows are chosen evenly across the split.
    """
    _check_window(tokens, batch_size, seq_len)
    if max_batches is not None and max_batches <= 0:
        raise ValueError(f"max_batches must be positive or None, got max_batches={max_batches}")
    n_windows = (tokens.numel() - 1) // seq_len
    want = n_windows if max_batches is None else min(n_windows, max_batches * batch_size)
    # Evenly spaced distinct window indices: floor(i * W / want) is strictly increasing for want <= W.
    window_idx = torch.arange(want) * n_windows // want
    starts = window_idx * seq_len
    for i in range(0, want, batch_size):
        yield _windows(tokens, starts[i : i + batch_size], seq_len, device)
