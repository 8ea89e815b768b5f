"""Running one `dropless` command in-process and judging what it did.

Every command's `main(argv)` (the table in cli.py) runs in this process with file descriptors 1 and 2
redirected to a file, so its prints, its warnings and a torchrun child's output (which inherits the
descriptors) are all kept. A call ends in one of three ways:
- it returns 0: the stage's own checks then look at what it wrote (`Stage.check`);
- it returns 2 with `error: MESSAGE` (how every command reports a ValueError): a refusal, accepted
  only when MESSAGE names a dotted config field (`model.`, `train.`, `data.`, `parallel.`) and the row's
  folder holds exactly the files it held before the call (refused before anything was written);
- anything else (another exit status, an exception, a refusal that names no field or wrote a file):
  a failure, with the traceback or the output's tail.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import sys
import tempfile
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

FIELD = re.compile(r"(?<![\w.-])(model|train|data|parallel|log)\.[a-z_][\w.]*")
TAIL = 4000  # characters of a failing call's output kept in the report


class Refused(Exception):
    """A stage (or one of its calls) refused with a ValueError naming a field: the message."""


class Skipped(Exception):
    """A stage cannot run: what it needs is missing (shown as `-`)."""


class Failed(Exception):
    """A stage failed: the first line says what, `detail` holds the traceback or the output."""

    def __init__(self, what: str, detail: str = "") -> None:
        super().__init__(what)
        self.detail = detail


@dataclass
class Call:
    argv: list[str]
    rc: int | None  # None: it raised
    stdout: str
    stderr: str
    error: str = ""  # the traceback when it raised

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


# The commands the stages call, as cli.py's table maps them (this package sits below cli, so it
# keeps its own copy; tests/check/test_matrix.py checks the two agree).
MODULES = {
    "train": "dropless.train.run", "generate": "dropless.serve.generate_cli", "evaluate": "dropless.serve.evaluate_cli",
    "diagnose": "dropless.monitor.report", "record-routing": "dropless.serve.record_routing",
    "routing-mismatch": "dropless.serve.mismatch", "quantize": "dropless.serve.quantize",
    "plan": "dropless.plan.cli", "export-hf": "dropless.hf.export_hf", "import-hf": "dropless.hf.import_cli",
    "bench generate": "dropless.bench.generate", "prepare-data": "dropless.data.prepare",
    "merge-lora": "dropless.hf.merge_lora",
}


@contextmanager
def captured(out: Path, err: Path) -> Iterator[None]:
    """fds 1 and 2 into `out` and `err` while the block runs (a child process's output, C++ warnings),
    and sys.stdout/stderr with them: whoever runs us may have replaced those (pytest does)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved, streams = (os.dup(1), os.dup(2)), (sys.stdout, sys.stderr)
    with open(out, "wb") as fo, open(err, "wb") as fe:
        os.dup2(fo.fileno(), 1)
        os.dup2(fe.fileno(), 2)
        sys.stdout, sys.stderr = (io.TextIOWrapper(os.fdopen(os.dup(fd), "wb"), encoding="utf-8", errors="replace",
                                                   line_buffering=True) for fd in (1, 2))
        try:
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.close()
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and modification time."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def invoke(command: str, argv: list[str], root: Path) -> Call:
    """`dropless COMMAND ARGV` in this process; raises Refused or Failed unless it returned 0."""
    before = snapshot(root)
    rc, error = None, ""
    with tempfile.TemporaryDirectory(prefix="matrix-call-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with captured(out, err):
            try:
                main = importlib.import_module(MODULES[command]).main
                rc = int(main(list(argv)) or 0)
            except SystemExit as exit_:
                rc = exit_.code if isinstance(exit_.code, int) else 1
            except BaseException:  # noqa: BLE001  (anything a command raises is the row's failure)
                error = traceback.format_exc()
        call = Call([command, *argv], rc, out.read_text(errors="replace"), err.read_text(errors="replace"), error)
    if rc == 0:
        return call
    output = call.output
    shown = "dropless " + " ".join(call.argv)
    if rc is None:
        raise Failed(f"{shown}: raised {error.strip().splitlines()[-1]}", error + "\n" + output[-TAIL:])
    message = refusal_message(call.stderr)
    if rc != 2 or message is None:
        raise Failed(f"{shown}: exit status {rc}", output[-TAIL:])
    if not FIELD.search(message):
        raise Failed(f"{shown}: refused without naming a config field: {message}", output[-TAIL:])
    after = snapshot(root)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed:
        raise Failed(f"{shown}: refused after writing {', '.join(changed[:5])}: {message}", output[-TAIL:])
    raise Refused(message)


def refusal_message(output: str) -> str | None:
    """The ValueError message of a command's `dropless CMD: error: MESSAGE` line (the last one)."""
    found = re.findall(r"^dropless [\w-]+: error: (.*)$", output, flags=re.M)
    return found[-1] if found else None
