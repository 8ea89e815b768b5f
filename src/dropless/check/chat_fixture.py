"""A small chat fine-tuning setup built on the spot: a byte-level BPE tokenizer with a ChatML chat
template (tokenizer.json + tokenizer_config.json, as a Hugging Face checkpoint ships them) and a JSONL
of synthetic conversations. The matrix's chat rows and the chat tests train on it; nothing is
downloaded.

The conversations are arithmetic questions with their answers (a system turn in some, two exchanges
in others), so a model can learn them and the assistant replies differ from the prompts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..data.tokenizer import train_byte_bpe

__all__ = ["CHATML", "SPECIALS", "conversations", "write_chat_setup", "write_tokenizer"]

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def conversations(n: int, seed: int = 0) -> list[dict]:
    """`n` records {"messages": [...]}: deterministic for a seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": "You add numbers."})
        messages += [{"role": "user", "content": f"What is {a} plus {b}?"},
                     {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        if rng.random() < 0.4:
            c = rng.randint(0, 9)
            messages += [{"role": "user", "content": f"And plus {c}?"},
                         {"role": "assistant", "content": f"That makes {a + b + c}."}]
        out.append({"messages": messages})
    return out


def write_tokenizer(folder: Path, texts: list[str], vocab_size: int = 320) -> Path:
    """A byte-level BPE of `vocab_size` ids (the specials included) trained on `texts`, with the ChatML
    template; returns the tokenizer.json path."""
    folder.mkdir(parents=True, exist_ok=True)
    train_byte_bpe(texts, folder, vocab_size, specials=SPECIALS)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 1 << 20}, indent=1))
    return folder / "tokenizer.json"


def write_chat_setup(folder: Path, n: int = 200, seed: int = 0, vocab_size: int = 320) -> tuple[Path, Path]:
    """(tokenizer.json, chat.jsonl) under `folder`: the tokenizer trained on the conversations' text."""
    records = conversations(n, seed)
    texts = [m["content"] for r in records for m in r["messages"]] + ["def import os\n"]
    tokenizer = write_tokenizer(folder / "tokenizer", texts, vocab_size)
    data = folder / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return tokenizer, data
