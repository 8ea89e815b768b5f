"""`dropless record-routing`: the trainer's full-sequence forward over given tokens, its routing saved.

    dropless record-routing --run-dir RUN (--from RECORD_OR_TEXTFILE | --val N [--seq-len S])
                            [--dtype fp32|bf16] [--device auto|cpu|cuda] --out FILE

Legend: L MoE layers, S tokens of a sequence, K experts per token.

The forward is the trainer's: `model(tokens_1S)` over the whole sequence at once, under autocast in
`--dtype` (the router GEMM is fp32 either way), and each MoE layer's choice `out.moe[i].ids_TK`. Each
sequence runs alone (batch 1): no padding, and no dependence on which other sequences share its
batch (fp32 GEMM rows can round differently with the batch around them, docs/numerics.md).

Token sources:
- `--from RECORD`: the tokens of an existing routing record (a rollout's), every token routed, so
  `dropless routing-mismatch` can compare the two on the same tokens;
- `--from TEXTFILE`: one sequence per non-empty line, encoded with the run's tokenizer;
- `--val N`: N windows of `--seq-len` tokens spread evenly over the run's validation split (the
  trainer's evaluation windows).
Sequences longer than model.max_seq_len are refused.

Recording from a sampler (`dropless generate --record-routing FILE`) needs one call per run:
`RoutingRecord.for_model(model, tokens, ids, source, run_dir, step).save(FILE)` with, per
sequence, its tokens and the [L, R, K] ids of the R tokens that went through the model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..model import MoEModel
from ..device import resolve_device
from ..runs.sinks import Progress
from ..data.tokenizer import load_tokenizer
from .evaluate import DTYPES, autocast, val_windows
from ..hf.load_run import load_model
from ..runs.load import run_config
from ..data.routing_record import MAGIC, RoutingRecord


def checkpoint_step(run_dir: str | Path) -> int | None:
    """The step of the run's latest checkpoint (its folder is named step_NNNNNN)."""
    _, path = run_config(run_dir)
    try:
        return int(path.name.rsplit("_", 1)[-1])
    except ValueError:
        return None


@torch.no_grad()
def route(model: MoEModel, tokens_S: torch.Tensor, dtype: str = "fp32") -> torch.Tensor:
    """ids [L, S, K] (int64, CPU) of one sequence's full-sequence forward in `dtype`."""
    device = model.embed.weight.device
    with autocast(device, dtype):
        out = model(tokens_S.to(device).view(1, -1))
    if not out.moe:
        return torch.zeros(0, tokens_S.numel(), model.cfg.moe.top_k, dtype=torch.long)
    return torch.stack([m.ids_TK for m in out.moe]).cpu()


def record(model: MoEModel, sequences: list[torch.Tensor], dtype: str, run_dir: str | Path,
           step: int | None, progress: bool = True) -> RoutingRecord:
    """Route every sequence (one forward each) and wrap the choices in a record of this model."""
    S_max = max((s.numel() for s in sequences), default=0)
    if S_max > model.cfg.max_seq_len:
        raise ValueError(f"a sequence of {S_max} tokens exceeds model.max_seq_len={model.cfg.max_seq_len}")
    bar = Progress(len(sequences), 0, progress)
    ids = []
    try:
        for n, tok in enumerate(sequences):
            ids.append(route(model, tok, dtype))
            bar.update(n + 1, {})
    finally:
        bar.close()
    return RoutingRecord.for_model(model, sequences, ids, f"full forward {dtype}", run_dir, step)


def read_sequences(args: argparse.Namespace, cfg) -> list[torch.Tensor]:
    if args.val is not None:
        if args.val < 1:
            raise ValueError(f"--val {args.val}: must be >= 1")
        S = args.seq_len or cfg.train.seq_len
        windows = [w.x_BS[i] for w in val_windows(cfg, S).evaluation(args.val, 1) for i in range(len(w.x_BS))]
        if len(windows) < args.val:
            raise ValueError(f"--val {args.val}: the validation split holds only {len(windows)} windows "
                             f"of {S} tokens")
        return windows
    path = Path(args.source)
    if not path.is_file():
        raise FileNotFoundError(f"--from {path}: no such file")
    with open(path, "rb") as f:
        is_record = f.read(len(MAGIC)) == MAGIC
    if is_record:
        return RoutingRecord.load(path).tokens
    tok = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--from {path}: no non-empty line to use as a sequence")
    return [torch.tensor(tok.encode(line), dtype=torch.long) for line in lines]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dropless record-routing",
                                description="Record the full-sequence forward's routing over given tokens.")
    p.add_argument("--run-dir", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="source", help="a routing record (its tokens) or a text file (one "
                                                   "sequence per non-empty line)")
    src.add_argument("--val", type=int, default=None, metavar="N",
                     help="N windows of the run's validation split")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per --val window (default train.seq_len)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    p.add_argument("--out", required=True, help="routing record to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.seq_len < 0:
            raise ValueError(f"--seq-len {args.seq_len}: must be >= 1 (or 0: train.seq_len)")
        out = Path(args.out)
        if not out.parent.is_dir():
            raise FileNotFoundError(f"--out {out}: folder {out.parent} does not exist")
        cfg, _ = run_config(args.run_dir)
        sequences = read_sequences(args, cfg)
        model, cfg = load_model(args.run_dir, resolve_device(args.device)[0])
        rec = record(model, sequences, args.dtype, args.run_dir, checkpoint_step(args.run_dir))
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless record-routing: error: {err}", file=sys.stderr)
        return 2
    rec.save(out)
    R = sum(i.shape[1] for i in rec.ids)
    print(f"{out}: {len(rec.tokens)} sequences, {R} tokens routed through {len(rec.moe_layers)} MoE "
          f"layers ({rec.source}), {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
