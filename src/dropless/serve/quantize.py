"""`dropless quantize RUN_DIR --experts mxfp4|nvfp4 --out RUN_DIR2 [--report]`: store a trained run's
routed experts in 4 bits, and measure what that saves and costs.

Only the MoE layers' `experts.w_gate_up_EDF` / `experts.w_down_EFD` are packed (layers/packed_experts.py
says which numbers, runs/packed.py the directory format); every other tensor is kept as the checkpoint
stored it. RUN_DIR2 loads with `serve.load.load_model`, so `evaluate` and `generate` run from it.

`--report` (with or without --out) prints, for the original model and each packed one:
- bytes on disk (the torch.save file of the model's state; the original checkpoint also holds the
  optimizer state, left out here) and in memory (distinct storages, the tied embedding once), and
  the routed experts' share;
- bytes read per decoded token: every non-expert tensor (an upper bound: the embedding lookup reads one
  row, but the tied LM head reads the whole matrix) plus, per MoE layer, the experts that step uses.
  For one sequence that is K experts; for B sequences decoded together it is the distinct routed experts
  among their B*K choices, measured on the validation windows (B windows at the same position) from the
  original model's routing, beside the count uniform routing would give, E * (1 - (1 - K/N)^B) for E
  routed of N selectable experts (identity experts, layers/identity.py, are chosen but read no weights);
- the validation loss in bf16 autocast (`serve.evaluate.val_loss(..., dtype="bf16")`) and its change
  against the original.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .. import atomic
from ..config import RunConfig
from ..layers.packed_experts import PACKED_FORMATS, check_format
from ..model import MoEModel
from ..data.windows import Windows
from ..runs import packed
from .evaluate import val_loss, val_windows
from ..hf.load_run import load_model
from ..runs.load import run_config

BATCH_SIZES = (1, 4, 16)


def _file_bytes(model: MoEModel) -> int:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.getbuffer().nbytes


def _as_bf16(model: MoEModel) -> dict[str, int]:
    """model_bytes with every floating-point tensor stored in bf16 (the shapes' analytic figure)."""
    def size(t: torch.Tensor) -> int:
        return t.numel() * (2 if t.is_floating_point() else t.element_size())
    seen_all = {t.untyped_storage().data_ptr(): size(t) for t in model.state_dict().values()}
    seen_exp = {t.untyped_storage().data_ptr(): size(t) for layer in model.moe_layers()
                for t in layer.experts.state_dict().values()}
    return {"total": sum(seen_all.values()), "experts": sum(seen_exp.values())}


def distinct_experts(model: MoEModel, cfg: RunConfig, windows: Windows) -> dict[int, list[float]]:
    """Per batch size B, per MoE layer: mean number of distinct routed experts chosen by B validation
    windows' tokens at the same position (what one decode step of B sequences reads: an identity
    expert reads no weights)."""
    slots = model.expert_slots()
    x = next(iter(windows.evaluation(cfg.train.batch_size, 1))).x_BS
    with torch.no_grad():
        out = model(x)
    n, S = x.shape
    result: dict[int, list[float]] = {}
    for B in (b for b in BATCH_SIZES if b <= n):
        per_layer = []
        for m in out.moe:
            K = m.ids_TK.shape[-1]
            valid_TK = (torch.ones_like(m.ids_TK, dtype=torch.int64) if m.valid_TK is None
                        else m.valid_TK.long())  # variable-count strategies mark their empty slots

            def by_step(t_TK: torch.Tensor) -> torch.Tensor:  # [n*S, K] -> [n/B, S, B*K]
                t = t_TK.reshape(n, S, K)[: n // B * B].view(n // B, B, S, K)
                return t.permute(0, 2, 1, 3).reshape(n // B, S, B * K)

            hits_GSE = torch.zeros(n // B, S, slots.selectable, dtype=torch.int64)
            hits_GSE.scatter_add_(-1, by_step(m.ids_TK.long()), by_step(valid_TK))
            per_layer.append(float((hits_GSE[..., :slots.routed] > 0).sum(-1).float().mean()))
        result[B] = per_layer
    return result


def report(run_dir: str | Path, variants: dict[str, MoEModel], original: MoEModel, cfg: RunConfig,
           max_batches: int | None = None) -> dict[str, Any]:
    """The figures of the module docstring for `original` and each packed model in `variants`."""
    windows = val_windows(cfg)
    slots = original.expert_slots()
    E, N, K, L = slots.routed, slots.selectable, cfg.model.moe.top_k, len(original.moe_layers())
    distinct = distinct_experts(original, cfg, windows)
    uniform = {B: E * (1 - (1 - K / N) ** B) for B in distinct}
    rows = []
    models = {"original": original, **variants}
    for name, model in tqdm(models.items(), desc="evaluating", file=sys.stderr):
        mem = packed.model_bytes(model)
        per_expert = mem["experts"] // (L * E) if L else 0
        bf16 = _as_bf16(model)  # the non-expert tensors cast to bf16 (packed experts unchanged)
        row = {"variant": name, "file_bytes": _file_bytes(model), "memory_bytes": mem["total"],
               "expert_bytes": mem["experts"], "expert_share": mem["experts"] / mem["total"],
               "memory_bytes_rest_bf16": bf16["total"], "bytes_per_expert": per_expert,
               "bf16_bytes_per_expert": bf16["experts"] // (L * E) if L else 0,
               "val_loss_bf16": val_loss(model, cfg, windows, "bf16", max_batches)}
        for rest, total, pe in (("stored", mem, row["bytes_per_expert"]),
                                ("bf16", bf16, row["bf16_bytes_per_expert"])):
            non_expert = total["total"] - total["experts"]
            row[f"read_per_token_rest_{rest}"] = {
                B: (non_expert + pe * sum(distinct[B])) / B for B in distinct}
        rows.append(row)
    base = rows[0]["val_loss_bf16"]
    for row in rows:
        row["val_loss_change"] = row["val_loss_bf16"] / base - 1
    return {"run_dir": str(run_dir), "num_experts": E, "identity_experts": slots.identity, "top_k": K,
            "moe_layers": L,
            "distinct_experts_per_layer": distinct, "distinct_experts_uniform": uniform,
            "eval_batches": max_batches or cfg.train.eval_batches, "rows": rows}


def format_report(r: dict[str, Any]) -> str:
    mb = 1e6
    ident = f" (+{r['identity_experts']} identity)" if r.get("identity_experts") else ""
    lines = [f"{r['run_dir']}: E={r['num_experts']}{ident} K={r['top_k']} MoE layers={r['moe_layers']}, "
             f"val loss over {r['eval_batches']} batches, bf16 autocast",
             f"{'variant':<10}{'file MB':>9}{'memory MB':>11}{'experts MB':>12}{'share':>7}"
             f"{'mem MB, rest bf16':>19}{'val_loss':>10}{'change':>9}"]
    for row in r["rows"]:
        lines.append(f"{row['variant']:<10}{row['file_bytes'] / mb:>9.2f}{row['memory_bytes'] / mb:>11.2f}"
                     f"{row['expert_bytes'] / mb:>12.2f}{row['expert_share']:>7.1%}"
                     f"{row['memory_bytes_rest_bf16'] / mb:>19.2f}{row['val_loss_bf16']:>10.4f}"
                     f"{row['val_loss_change']:>+9.2%}")
    Bs = list(r["distinct_experts_per_layer"])
    lines += ["", "bytes read per decoded token (MB), non-expert tensors as stored | in bf16; B sequences "
              "decoded together"]
    lines.append(f"{'variant':<10}" + "".join(f"{f'B={B}':>20}" for B in Bs))
    for row in r["rows"]:
        cells = [f"{row['read_per_token_rest_stored'][B] / mb:.3f} | "
                 f"{row['read_per_token_rest_bf16'][B] / mb:.3f}" for B in Bs]
        lines.append(f"{row['variant']:<10}" + "".join(f"{c:>20}" for c in cells))
    counts = ", ".join(f"B={B}: {sum(v) / len(v):.2f} | {r['distinct_experts_uniform'][B]:.2f}"
                       for B, v in r["distinct_experts_per_layer"].items())
    lines.append(f"distinct experts per MoE layer per step (measured, layer mean | uniform): {counts}")
    return "\n".join(lines)


def quantize_run(run_dir: str | Path, fmt: str, out: str | Path) -> Path:
    """Pack RUN_DIR's latest checkpoint into the run directory `out`; every check comes before any
    write, and the write is atomic (runs/packed.py)."""
    check_format(fmt)  # the format first, before any file is read
    atomic.require_empty_dir(out, "--out")
    if packed.is_packed_run(run_dir):
        raise ValueError(f"RUN_DIR={str(run_dir)!r} is already a packed run; quantise the original run")
    cfg, path = run_config(run_dir)
    if cfg.train.lora.enabled:  # its experts are a base plus adapters: packing the base alone drops them
        raise ValueError(f"train.lora.rank={cfg.train.lora.rank}: {run_dir} is a LoRA run; merge it first "
                         "(dropless merge-lora RUN --out RUN2) and quantise RUN2")
    shapes = packed.meta_model(cfg.model)  # the widths as the modules have them, nothing allocated
    if not shapes.moe_layers():
        raise ValueError(f"model.n_dense_layers={cfg.model.n_dense_layers} = model.n_layers: the run has "
                         "no routed experts to pack")
    packed.check_model_packable(shapes, fmt)
    model, cfg = load_model(run_dir, "cpu")
    step = int(path.name.split("_")[-1])
    return packed.save_packed(packed.pack_model(model, fmt), cfg, out, fmt, run_dir, step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless quantize",
                                description="Store a run's routed experts in 4 bits (mxfp4 | nvfp4).")
    p.add_argument("run_dir", help="a trained run directory (its latest checkpoint is packed)")
    p.add_argument("--experts", default=None,
                   help=f"4-bit format of the routed experts: {' | '.join(PACKED_FORMATS)} (--report "
                        "without --out: default both)")
    p.add_argument("--out", default=None, help="new run directory to write (absent or empty)")
    p.add_argument("--report", action="store_true",
                   help="print bytes on disk / in memory / read per token and the bf16 val loss of "
                        "the original and the packed model(s)")
    p.add_argument("--max-batches", type=int, default=None,
                   help="validation batches for --report (default: the run's train.eval_batches)")
    p.add_argument("--json", default=None, help="also write the --report figures to this file")
    args = p.parse_args(argv)
    try:
        if args.out is None and not args.report:
            raise ValueError("--out is required (or --report to measure without writing)")
        if args.out is not None and args.experts is None:
            raise ValueError("--experts is required with --out: one of " + ", ".join(PACKED_FORMATS))
        formats = [args.experts] if args.experts else list(PACKED_FORMATS)
        for fmt in formats:
            check_format(fmt)
        if args.max_batches is not None and args.max_batches < 1:
            raise ValueError(f"--max-batches={args.max_batches}: must be >= 1")
        if args.out is not None:
            out = quantize_run(args.run_dir, args.experts, args.out)
            print(f"wrote {out} ({args.experts} routed experts)", file=sys.stderr)
        if args.report:
            lora = run_config(args.run_dir)[0].train.lora
            if lora.enabled:  # (as quantize_run: the packed experts would drop the adapters), before the load
                raise ValueError(f"train.lora.rank={lora.rank}: {args.run_dir} is a LoRA run; merge "
                                 "it first (dropless merge-lora RUN --out RUN2) and report on RUN2")
            original, cfg = load_model(args.run_dir, "cpu")
            if args.out is not None:  # the written directory, loaded back as evaluate would
                variants = {args.experts: load_model(args.out, "cpu")[0]}
            else:
                for fmt in formats:
                    packed.check_model_packable(original, fmt)
                variants = {fmt: packed.pack_model(copy.deepcopy(original), fmt) for fmt in formats}
            r = report(args.run_dir, variants, original, cfg, args.max_batches)
            print(format_report(r))
            if args.json:
                atomic.write_text(args.json, json.dumps(r, indent=1) + "\n")
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless quantize: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
