"""A run's train and validation data as token runs (data/windows.py), from whichever source the data
section names: a prepared folder (memory-mapped, data/prepared.py), chat JSONL (rendered with the
tokenizer's chat template, data/chat.py), or text (user files or the embedded corpus, encoded in
memory as data/batches.py always has).

Text documents are joined by batches.SEPARATOR; each document's run starts at its first token and the
separator after it belongs to it (the model learns where a document ends). Chat examples are
concatenated as rendered (a template ends each turn itself) with their assistant-token masks.
Splits are by document name (corpus.is_validation); when that leaves a side empty (one file, a few
documents), text falls back to the last `val_fraction` of the token stream and chat to the last
`val_fraction` of the examples (at least one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..config import DataConfig
from .batches import SEPARATOR, encode_documents
from .corpus import Document, is_validation, read_documents, split_documents, stdlib_documents
from .tokenizer import ByteTokenizer, Tokenizer
from .windows import TokenRun, Windows

__all__ = ["Splits", "load_runs", "split_windows", "text_run", "chat_run"]


@dataclass(frozen=True)
class Splits:
    train: list[TokenRun]
    val: list[TokenRun]
    chat: bool  # the runs carry assistant-token loss masks
    source: str  # for the log: what was read


def text_run(docs: Sequence[Document], tokenizer: Tokenizer) -> TokenRun:
    """The documents joined by SEPARATOR (batches.encode_documents' tokens) and where each starts."""
    if isinstance(tokenizer, ByteTokenizer):  # bytes are ids: batches.encode_documents' fast path
        tokens = encode_documents(docs, tokenizer).numpy()
        lengths = [len(d.data) + len(SEPARATOR) for d in docs[:-1]]
    else:  # batches.encode_documents_reference's tokens, each document's count kept
        sep = tokenizer.encode(SEPARATOR.decode("utf-8"))
        ids = [tokenizer.encode(d.data.decode("utf-8", errors="replace")) for d in docs]
        lengths = [len(i) + len(sep) for i in ids[:-1]]
        joined = [t for i, doc in enumerate(ids) for t in (sep + doc if i else doc)]
        tokens = np.asarray(joined, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    return TokenRun(tokens, starts[starts < max(len(tokens), 1)])


def _cut(run: TokenRun, cut: int) -> tuple[TokenRun, TokenRun]:
    """A run split at token `cut`: the second part's first document starts at its first token."""
    head = run.starts[run.starts < cut]
    tail = run.starts[run.starts >= cut] - cut
    tail = tail if len(tail) and tail[0] == 0 else np.concatenate([[0], tail]).astype(np.int64)
    loss = (None, None) if run.loss is None else (run.loss[:cut], run.loss[cut:])
    return TokenRun(run.tokens[:cut], head, loss[0]), TokenRun(run.tokens[cut:], tail, loss[1])


def chat_run(examples: Sequence) -> TokenRun:
    """Rendered chat examples (data/chat.py ChatExample: ids, loss) end to end."""
    lengths = [len(e.ids) for e in examples]
    starts = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype(np.int64)
    return TokenRun(np.concatenate([e.ids for e in examples]).astype(np.int64), starts,
                    np.concatenate([e.loss for e in examples]).astype(np.uint8))


def _text_splits(d: DataConfig, tokenizer: Tokenizer) -> Splits:
    if d.sources:
        docs = read_documents(d.sources, text_field=d.text_field, max_bytes=d.max_bytes or None)
    else:
        docs = stdlib_documents(max_bytes=d.max_bytes or None)
    train_docs, val_docs = split_documents(docs, d.val_fraction)
    source = f"{len(docs)} documents" + ("" if d.sources else " (embedded corpus)")
    if not train_docs or not val_docs:
        run = text_run(docs, tokenizer)
        train, val = _cut(run, len(run.tokens) - max(1, int(len(run.tokens) * d.val_fraction)))
        return Splits([train], [val], False, source)
    return Splits([text_run(train_docs, tokenizer)], [text_run(val_docs, tokenizer)], False, source)


def _chat_splits(d: DataConfig, seq_len: int) -> Splits:
    from .chat import ChatTemplate, read_chat  # transformers, only for chat data

    if d.tokenizer != "hf":
        raise ValueError(f"data.tokenizer={d.tokenizer!r}: chat data in {d.sources} is rendered with an HF "
                         "tokenizer's chat template (data.tokenizer=hf, or --init-from hf:DIR)")
    template = ChatTemplate(d.tokenizer_path)
    examples = [e for src in d.sources for e in read_chat(src, template, max_tokens=seq_len + 1,
                                                          overlong=d.overlong, field=d.chat_field)]
    if not examples:
        raise ValueError(f"data.sources={d.sources}: no conversation found")
    val = [e for e in examples if is_validation(e.name, d.val_fraction)]
    train = [e for e in examples if not is_validation(e.name, d.val_fraction)]
    if not train or not val:
        n_val = max(1, int(len(examples) * d.val_fraction))
        if n_val >= len(examples):
            raise ValueError(f"data.sources={d.sources}: {len(examples)} conversation(s), too few for a "
                             "train and a validation split")
        train, val = examples[:-n_val], examples[-n_val:]
    return Splits([chat_run(train)], [chat_run(val)], True, f"{len(examples)} conversations")


def _is_chat(d: DataConfig) -> bool:
    if not any(Path(s).suffix == ".jsonl" for s in d.sources):
        return False
    from .chat import is_chat_jsonl

    kinds = {str(s): Path(s).suffix == ".jsonl" and Path(s).is_file() and is_chat_jsonl(s, d.chat_field)
             for s in d.sources}
    if any(kinds.values()) and not all(kinds.values()):
        chat = [s for s, c in kinds.items() if c]
        raise ValueError(f"data.sources={list(kinds)}: mixes chat JSONL ({chat}) with text; train on one "
                         "kind at a time")
    return bool(kinds) and all(kinds.values())


def load_runs(d: DataConfig, tokenizer: Tokenizer, seq_len: int) -> Splits:
    """The train and validation runs the data section names (module note)."""
    if d.prepared:
        from .prepared import open_prepared

        train, val = open_prepared(d.prepared, tokenizer, val_fraction=d.val_fraction,
                                   chat_template=_template_identity(d))
        chat = any(r.loss is not None for r in train)
        if chat and d.overlong == "refuse":
            _refuse_overlong(d.prepared, {"train": train, "val": val}, seq_len + 1)
        return Splits(train, val, chat, f"prepared {d.prepared}")
    if _is_chat(d):
        return _chat_splits(d, seq_len)
    return _text_splits(d, tokenizer)


def _refuse_overlong(folder: str, splits: dict[str, list[TokenRun]], limit: int) -> None:
    """A prepared conversation longer than the window, named by split, shard and place (with
    data.overlong=truncate a window holds its first `limit` tokens)."""
    for split, runs in splits.items():
        for k, run in enumerate(runs):
            lengths = np.diff(np.append(run.starts, len(run.tokens)))
            if (lengths > limit).any():
                i = int(np.argmax(lengths > limit))
                raise ValueError(f"prepared data {folder!r}: conversation {i} of {split} shard {k} has "
                                 f"{int(lengths[i])} tokens, more than the limit of {limit} "
                                 "(train.seq_len + 1); set data.overlong=truncate to cut it, or raise "
                                 "train.seq_len")


def _template_identity(d: DataConfig) -> dict | None:
    """The run's chat template identity, to compare with a prepared chat folder's (None: byte tokenizer)."""
    if d.tokenizer != "hf":
        return None
    from .chat import ChatTemplate

    try:
        return ChatTemplate(d.tokenizer_path).identity
    except ValueError:  # no chat template: fine for text folders; a chat folder then refuses
        return {}


def split_windows(d: DataConfig, splits: Splits, seq_len: int) -> tuple[Windows, Windows]:
    """(train, validation) windows as the data section says: chat examples drawn from their starts
    with document masking and the loss on assistant replies unless set otherwise; text as set."""
    loss_on = ("assistant" if splits.chat else "all") if d.loss_on == "auto" else d.loss_on
    if loss_on == "assistant" and not splits.chat:
        raise ValueError(f"data.loss_on='assistant': {splits.source} is text, with no assistant replies "
                         f"(chat data is a .jsonl of conversations in data.chat_field={d.chat_field!r})")
    if splits.chat and d.document_mask is False:
        raise ValueError(f"data.document_mask=False: {splits.source} are chat examples, packed with "
                         "document masking (a reply attends to its own conversation only); leave it unset")
    kw = dict(aligned=splits.chat, document_mask=splits.chat if d.document_mask is None else d.document_mask,
              loss_masked=loss_on == "assistant")
    return (Windows(splits.train, seq_len, what="train split", **kw),
            Windows(splits.val, seq_len, what="validation split", **kw))
