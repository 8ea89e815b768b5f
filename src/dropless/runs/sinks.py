"""Where a run's numbers go: JSONL files, TensorBoard events, a progress bar.

Files in a run directory (one JSON object per line, appended as the run goes):
    metrics.jsonl   training rows {"step", "loss", "ce_loss", "moe_loss", "lr", "grad_norm",
                    "tokens_per_s", "maxvio_global", "maxvio_local", ...} and evaluation rows
                    {"step", "val_loss"} (nats per token)
    routing.jsonl   per log step, per MoE layer: expert counts and routing-health figures
On resume, rows at or after the resumed step are dropped first, so a resumed run's files read as if
the run had never stopped.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from .. import atomic


class JsonlLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    def truncate_from(self, step: int) -> None:
        """Drop rows with row['step'] >= step (they belong to a run that stopped after its checkpoint)."""
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", -1) < step]
        # atomically: a crash in the middle of the cut must not lose the run's history
        atomic.write_text(self.path, "".join(line + "\n" for line in keep))

    def read(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class TensorBoard:
    """TensorBoard scalars when the package is there; otherwise a no-op (said once)."""

    def __init__(self, log_dir: Path, enabled: bool) -> None:
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("note: TensorBoard events are off (pip install tensorboard to write them)", file=sys.stderr)
            return
        self.writer = SummaryWriter(str(log_dir))

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            if isinstance(value, (int, float)) and key != "step":
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Progress:
    """A progress bar on stderr (tqdm when installed, a plain line every few seconds otherwise)."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.bar = None
        self.enabled = enabled
        self.total = total
        self.last_print = 0.0
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, done: int, fields: dict[str, str]) -> None:
        """`done` steps are complete; `fields` are shown beside the bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix(fields)
            return
        now = time.monotonic()
        if now - self.last_print > 5 or done == self.total:
            self.last_print = now
            text = " ".join(f"{k}={v}" for k, v in fields.items())
            print(f"step {done}/{self.total} {text}", file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)  # tqdm.write defaults to stdout
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
