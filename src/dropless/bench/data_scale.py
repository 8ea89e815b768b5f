"""`dropless bench data-scale`: training memory and data time against the size of a prepared corpus.

    python -m dropless.bench.data_scale [--small-mb 20] [--large-gtokens 2.1] [--steps 50]
        [--workdir DIR] [--set FIELD=VALUE ...]

It writes two synthetic JSONL corpora (random words, documents of 0.5-8 KB, deterministic), the
small one of --small-mb MB and the large one of --large-gtokens billion bytes, prepares both with
the byte tokenizer (uint16 shards: 2 bytes a token on disk), then trains the default preset for
--steps steps on each (`dropless train --set data.prepared=DIR`, document masking on, its own
process) and reports per run: the shards' size, the peak RSS of the training process (its
rusage, read by os.wait4), the trainer's mean `data_ms` and `step_ms` (metrics.jsonl), and the
large/small RSS ratio. The prepared folders are kept in --workdir for reruns (prepare-data finds
them finished).

RSS stays flat because the shards are memory-mapped and only the windows drawn are read; the
checksum pass before training reads the files with plain reads, which fill the page cache but not
the process's resident set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..data.prepare import prepare_data
from .timing import format_table

WORDS = 4096
DOC_BYTES = (512, 8192)


def synthetic_jsonl(path: Path, nbytes: int, seed: int = 0) -> None:
    """JSONL of documents made of random lowercase words until `nbytes` of text are written."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    vocab = [bytes(letters[rng.integers(0, 26, rng.integers(2, 9))]).decode() for _ in range(WORDS)]
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < nbytes:
            words = rng.integers(0, WORDS, 20_000)
            block = []
            for lo in range(0, len(words), 700):  # ~700 words: ~4 KB a document on average
                n = int(rng.integers(DOC_BYTES[0] // 6, DOC_BYTES[1] // 6))
                text = " ".join(vocab[w] for w in words[lo:lo + n])
                block.append(json.dumps({"text": text}))
                written += len(text)
                if written >= nbytes:
                    break
            f.write("\n".join(block) + "\n")


def prepared(workdir: Path, name: str, nbytes: int, workers: int) -> tuple[Path, int]:
    """(folder, bytes of its token files), made once."""
    src, out = workdir / f"{name}.jsonl", workdir / f"{name}-prepared"
    if not (out / "manifest.json").is_file():
        if not src.is_file():
            synthetic_jsonl(src, nbytes)
        prepare_data([src], out, workers=workers, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    size = sum(sh["files"]["tokens"]["bytes"] for sh in manifest["shards"])
    return out, size


def train(folder: Path, run_dir: Path, steps: int, sets: list[str]) -> dict[str, Any]:
    """One training process; its peak RSS from its own rusage, its step and data times from its log."""
    argv = [sys.executable, "-m", "dropless.cli", "train", "--run-dir", str(run_dir),
            "--set", f"data.prepared={folder}", "--set", "data.document_mask=true", "--set", f"train.steps={steps}",
            "--set", "log.progress=false", "--set", "log.plots=false", "--set", "log.tensorboard=false"]
    for s in sets:
        argv += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"training on {folder} failed (status {status}): {' '.join(argv)}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "data_ms" in r][1:]  # the first interval holds the warm-up
    return {"peak_rss_gib": usage.ru_maxrss * 1024 / 2**30, "wall_s": wall,
            "data_ms": float(np.mean([r["data_ms"] for r in timed])),
            "step_ms": float(np.mean([r["step_ms"] for r in timed]))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless bench data-scale", description=__doc__.split("\n")[0])
    p.add_argument("--small-mb", type=float, default=20.0)
    p.add_argument("--large-gtokens", type=float, default=2.1, help="billions of tokens (bytes) in the large corpus")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workdir", default=None, help="where the corpora and runs go (default: a temporary folder)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="config overrides for both runs")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="data-scale-")
    work = Path(args.workdir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, nbytes in [("small", int(args.small_mb * 1e6)), ("large", int(args.large_gtokens * 1e9))]:
        folder, size = prepared(work, name, nbytes, args.workers)
        run_dir = work / f"run-{name}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        r = train(folder, run_dir, args.steps, args.set)
        rows.append({"corpus": name, "token_files_gb": size / 1e9, **r})
        print(f"{name}: {rows[-1]}", flush=True)
    ratio = rows[1]["peak_rss_gib"] / rows[0]["peak_rss_gib"]
    for r in rows:
        r["data_share"] = f"{100 * r['data_ms'] / r['step_ms']:.2f}%"
    print(format_table(rows, ["corpus", "token_files_gb", "peak_rss_gib", "step_ms", "data_ms", "data_share",
                              "wall_s"]))
    print(f"peak RSS large / small: {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "rss_ratio": ratio}, indent=1))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
