"""The data a matrix row trains on, when its `data` value needs files made first (stage option
`stage.data`): a prepared folder of the row's corpus ("prepared"), or a chat fine-tuning setup
("chat": chat_fixture.py's tokenizer with a chat template and its conversations). Returns the
`--set` overrides that point the run at them; the row's other stages read them from the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..data.corpus import stdlib_documents
from .chat_fixture import write_chat_setup

CHAT_CONVERSATIONS = 60


def _corpus_folder(folder: Path, max_bytes: int) -> Path:
    """The row's capped embedded corpus as files, named as in the corpus (so the split is the same)."""
    for doc in stdlib_documents(max_bytes=max_bytes):
        path = folder / "stdlib" / doc.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(doc.data)
    return folder / "stdlib"


def data_sets(kind: str, root: Path, base: dict[str, str], call: Callable[..., object]) -> list[str]:
    """Overrides for `kind` ("" = none); `base`: the row's overrides as a dict; `call(command, *argv)`
    runs a dropless command (prepare-data) the way the row's other stages do."""
    if not kind:
        return []
    if kind == "prepared":
        corpus = _corpus_folder(root / "corpus", int(base["data.max_bytes"]))
        call("prepare-data", corpus, "--out", root / "prepared", "--no-progress")
        return [f"data.prepared={root / 'prepared'}", "data.max_bytes=0"]
    if kind == "chat":
        tokenizer, data = write_chat_setup(root / "chat", n=CHAT_CONVERSATIONS)
        return ["data.tokenizer=hf", f"data.tokenizer_path={tokenizer}", f"data.sources={json.dumps([str(data)])}",
                "data.max_bytes=0"]
    raise ValueError(f"stage.data={kind!r}: expected 'prepared' or 'chat'")
