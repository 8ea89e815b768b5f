"""Chat / instruction data: conversations rendered with the tokenizer's own chat template, plus a
per-token mask of what the model should learn to write.

Design notes
- A chat `.jsonl` holds one conversation per line, `{"messages": [{"role": ..., "content": ...}, ...]}`
  (extra keys such as `tool_calls` pass through to the template). The text the model trains on is
  what transformers' `apply_chat_template` writes with the checkpoint's own template (its
  `tokenizer_config.json` `chat_template`, or `chat_template.jinja`), so fine-tuning sees exactly the
  layout that serving the model will produce.
- The tokenizer is `PreTrainedTokenizerFast` over the run's `tokenizer.json`, loaded from its folder
  with `local_files_only=True` (never a download). Not `AutoTokenizer`: a model-specific class may
  rebuild its pipeline from vocab files, and the ids must match the plain `tokenizers` file that
  `tokenizer.HFTokenizer` encodes every other corpus with. Rendered strings are encoded with
  `add_special_tokens=False`, as `apply_chat_template(tokenize=True)` does: the template already
  writes BOS and the turn markers where it wants them.
- `loss[j] == 1` marks token j as one of an assistant reply's tokens: the reply and the end-of-turn
  token(s) after it (ChatML's `<|im_end|>`, so the model learns to stop), not the assistant header
  (`<|im_start|>assistant\\n`, the prompt for the reply) and not the whitespace a template writes
  between turns after that token (ChatML's "\\n": generation stops at `<|im_end|>`, so the model never
  writes it; trailing whitespace-only tokens of a reply's span are dropped for that reason).
- Two ways to find the replies. A template with `{% generation %}` blocks declares them itself; then
  transformers' `return_assistant_tokens_mask` is used (one render). Any other template gets prefix
  rendering: for assistant message i, messages[:i] with the generation prompt is the text up to the
  reply and messages[:i+1] the text through it; the tokens between are the reply's. That holds only
  if each partial render is a prefix of the full one, as text and as tokens, so both are checked: a
  template that rewrites earlier turns (e.g. drops an earlier reply's reasoning) or a tokenizer that
  merges tokens across the boundary is refused, never mislabelled. Cost: O(turns^2) renders per
  conversation, with one tokenizer object reused.
- Errors are `ValueError`s that start with `where` (file and line), raised before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ChatExample", "ChatTemplate", "is_chat_jsonl", "read_chat", "OVERLONG", "STANDARD_ROLES"]

OVERLONG = ("refuse", "truncate")
STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool"})
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatExample(NamedTuple):
    name: str  # "<file name>:<line number>", 1-based, as corpus.py names JSONL documents
    ids: np.ndarray  # int64 token ids of the rendered conversation
    loss: np.ndarray  # uint8, same length: 1 where the token belongs to an assistant reply


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "chat data needs the `transformers` package: pip install 'dropless[hf]'"
        ) from e
    return transformers


def is_chat_jsonl(path: str | Path, field: str = "messages") -> bool:
    """Whether `path` is a `.jsonl` whose first non-blank line is a JSON object with `field`."""
    p = Path(path)
    if p.suffix != ".jsonl" or not p.is_file():
        return False
    with p.open("rb") as fh:
        for line in fh:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:  # invalid JSON or UTF-8: not chat; the text reader reports it
                    return False
                return isinstance(record, dict) and field in record
    return False


class ChatTemplate:
    """The chat template and tokenizer of a local HF tokenizer folder; renders conversations."""

    def __init__(self, tokenizer_path: str | Path) -> None:
        p = Path(tokenizer_path).expanduser()
        folder = p if p.is_dir() else p.parent
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"ChatTemplate: no tokenizer.json in {str(folder)!r} "
                             f"(from tokenizer_path={str(tokenizer_path)!r})")
        transformers = _import_transformers()
        try:
            tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # malformed json files surface as assorted exception types
            raise ValueError(f"ChatTemplate: cannot load the tokenizer in {str(folder)!r}: {e}") from e
        if not tok.chat_template:
            raise ValueError(f"ChatTemplate: the tokenizer in {str(folder)!r} has no chat template "
                             "(neither tokenizer_config.json 'chat_template' nor chat_template.jinja)")
        try:
            self.template: str = tok.get_chat_template()
        except ValueError as e:  # several named templates and none called "default"
            raise ValueError(f"ChatTemplate: {str(folder)!r}: {e}") from e
        self.folder = folder
        self._tok = tok
        self.method = "generation" if _GENERATION_TAG.search(self.template) else "prefix"
        self.identity = {"chat_template_sha256": hashlib.sha256(self.template.encode()).hexdigest()}

    def __repr__(self) -> str:
        return f"ChatTemplate(folder={str(self.folder)!r}, method={self.method!r})"

    def _text(self, messages: list[dict], where: str, generation_prompt: bool) -> str:
        try:
            return str(self._tok.apply_chat_template(
                messages, chat_template=self.template, tokenize=False,
                add_generation_prompt=generation_prompt))
        except Exception as e:  # jinja TemplateError, raise_exception(...), or the template's own bugs
            raise ValueError(f"{where}: the chat template refuses this conversation "
                             f"({type(e).__name__}: {e})") from e

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # What apply_chat_template(tokenize=True) does (the fast tokenizer's backend, no special tokens
        # added), as one batch: the Rust side encodes a batch on several threads.
        return [e.ids for e in self._tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]

    def _check(self, messages: Any, where: str) -> None:
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: messages must be a non-empty list of objects, "
                             f"got {type(messages).__name__}")
        for k, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ValueError(f"{where}: message {k} is {type(m).__name__}, expected an object")
            for key in ("role", "content"):
                if not isinstance(m.get(key), str):
                    got = "missing" if key not in m else type(m[key]).__name__
                    raise ValueError(f"{where}: message {k} {key!r} is {got}, expected str")
            role = m["role"]
            # A role outside the common four must be one the template names; ChatML-style templates
            # render any string, so a misspelt "assitant" would otherwise train as an unmasked turn.
            if role not in STANDARD_ROLES and f"'{role}'" not in self.template \
                    and f'"{role}"' not in self.template:
                raise ValueError(f"{where}: message {k} role {role!r} is not one the chat template "
                                 f"knows (expected one of {sorted(STANDARD_ROLES)} or a role the "
                                 "template names)")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: no assistant message (nothing to learn from)")

    def _trim(self, ids: list[int], start: int, end: int) -> int:
        """`end` moved back over whitespace-only tokens (the separator after the end-of-turn token)."""
        while end > start and not self._tok.decode(ids[end - 1:end]).strip():
            end -= 1
        return end

    def _generation_mask(self, messages: list[dict], where: str) -> tuple[list[int], np.ndarray]:
        try:
            out = self._tok.apply_chat_template(
                messages, chat_template=self.template, tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True)
        except Exception as e:
            raise ValueError(f"{where}: the chat template refuses this conversation "
                             f"({type(e).__name__}: {e})") from e
        return list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=np.uint8)

    def _prefix_mask(self, messages: list[dict], where: str) -> tuple[list[int], np.ndarray]:
        full = self._text(messages, where, generation_prompt=False)
        parts: list[tuple[int, str, str]] = []  # (assistant message index, "up to" | "through", text)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if i == 0:
                raise ValueError(f"{where}: message 0 is an assistant message; its reply has no prompt "
                                 "to follow, so where it starts is unknown")
            parts += [(i, "up to", self._text(messages[:i], where, generation_prompt=True)),
                      (i, "through", self._text(messages[:i + 1], where, generation_prompt=False))]
        for i, what, text in parts:
            if not full.startswith(text):
                raise ValueError(
                    f"{where}: the chat template rewrites earlier turns: the conversation rendered "
                    f"{what} assistant message {i} is not a prefix of the whole conversation's text, "
                    "so the reply's tokens cannot be told apart")
        ids, *encoded = self._encode([full] + [text for _, _, text in parts])
        for (i, what, _), part in zip(parts, encoded):
            if part != ids[:len(part)]:
                raise ValueError(
                    f"{where}: the tokenizer merges tokens across the boundary {what} assistant "
                    f"message {i}: that part's tokens are not a prefix of the whole conversation's")
        loss = np.zeros(len(ids), dtype=np.uint8)
        for start, end in zip(encoded[0::2], encoded[1::2]):
            loss[len(start):self._trim(ids, len(start), len(end))] = 1
        return ids, loss

    def render(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, loss uint8) of one conversation; `where` (file and line) starts every error."""
        self._check(messages, where)
        if self.method == "generation":
            ids, loss = self._generation_mask(messages, where)
        else:
            ids, loss = self._prefix_mask(messages, where)
        if not loss.any():
            raise ValueError(f"{where}: the rendered conversation has no assistant token to learn from")
        return np.asarray(ids, dtype=np.int64), loss


def _fit(ids: np.ndarray, loss: np.ndarray, where: str, max_tokens: int | None,
         overlong: str) -> tuple[np.ndarray, np.ndarray]:
    if max_tokens is None or len(ids) <= max_tokens:
        return ids, loss
    if overlong == "refuse":
        raise ValueError(f"{where}: {len(ids)} tokens, more than the limit of {max_tokens} "
                         "(train.seq_len + 1); set data.overlong=truncate to cut it, or raise train.seq_len")
    if not loss[:max_tokens].any():
        first = int(np.flatnonzero(loss)[0])
        raise ValueError(f"{where}: truncated to {max_tokens} tokens it keeps no assistant token (the first "
                         f"reply starts at token {first} of {len(ids)}); shorten it or raise train.seq_len")
    return ids[:max_tokens], loss[:max_tokens]


def read_chat(path: str | Path, template: ChatTemplate, *, max_tokens: int | None = None,
              overlong: str = "refuse", field: str = "messages", start: int = 0, stop: int | None = None,
              first_line: int = 1) -> list[ChatExample]:
    """Every conversation of a chat `.jsonl` (or of its bytes [start, stop), whole lines, the first
    numbered `first_line`: prepare-data's pieces), rendered, in line order; named "<file name>:<line>".
    Lines end at b"\\n" only, as corpus.jsonl_documents reads them, so pieces number lines as the
    whole file does."""
    if overlong not in OVERLONG:
        raise ValueError(f"data.overlong={overlong!r}: expected one of {OVERLONG}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 2):
        raise ValueError(f"read_chat: max_tokens must be an int >= 2 or None, got max_tokens={max_tokens!r}")
    p = Path(path).expanduser()
    try:
        with open(p, "rb") as f:
            f.seek(start)
            raw = f.read(-1 if stop is None else stop - start)
    except OSError as e:
        raise ValueError(f"cannot read chat file {str(p)!r}: {e}") from e
    out: list[ChatExample] = []
    for lineno, line in enumerate(raw.split(b"\n"), start=first_line):
        if not line.strip():
            continue
        where = f"{str(p)!r} line {lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg})") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 ({e.reason})") from e
        if not isinstance(record, dict) or field not in record:
            raise ValueError(f"{where}: no {field!r} field (a chat line is "
                             f'{{"{field}": [{{"role": ..., "content": ...}}, ...]}})')
        ids, loss = template.render(record[field], where)
        ids, loss = _fit(ids, loss, where, max_tokens, overlong)
        out.append(ChatExample(f"{p.name}:{lineno}", ids, loss))
    if not out and start == 0 and stop is None:
        raise ValueError(f"{str(p)!r}: no conversations (every line is blank)")
    return out
