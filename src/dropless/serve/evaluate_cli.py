"""`dropless evaluate`: a trained run's validation loss, as served (fewer experts, bf16).

    dropless evaluate --run-dir RUN [--serve-top-k K1] [--serve-norm-top-k K2] [--serve-renorm mass|kept]
                      [--dtype fp32|bf16] [--device auto|cpu|cuda] [--max-batches N] [--json FILE]
    dropless evaluate --run-dir RUN --serve-sweep [...]   # the docs/serving.md table in one run

The loss is `serve.evaluate.val_loss`: the trainer's validation windows, mean cross-entropy per token
in nats (nats per byte with the byte tokenizer). `--serve-sweep` evaluates the trained k and, for each
K1 < k, K2 in {K1, k, 2k} (those <= E) with renorm "mass" and the "kept" renormalisation, printing a
markdown table. Configurations that build the same model (mass with K2 = K1 is kept renormalisation
when the model renormalises) are evaluated once, under both names. Beside each loss: the mean over
tokens and MoE layers of the sum of the run experts' weights, the output scale the renormalisation
choice changes (1 x scaling factor for the trained model when it renormalises).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .. import atomic
from ..config import ModelConfig, RunConfig, to_dict
from ..expert_slots import ExpertSlots
from ..layers.router import RoutingDecision
from ..model import MoEModel
from ..device import resolve_device
from ..data.windows import Windows
from .evaluate import DTYPES, val_loss, val_windows
from ..hf.load_run import load_model
from ..runs.load import run_config
from .serving import add_serving_args, normalises, serving_map, serving_top_k, weight_denominator

Setting = tuple[int | None, int | None, str]  # (k1, k2, renorm) as given to serving_map


def sweep_settings(model_cfg: ModelConfig) -> list[Setting]:
    """The table's rows: the trained model, then for each K1 < k the mass rule at K2 in {K1, k, 2k}
    (K2 at most the experts the routing can choose from: E, or the experts group-limited routing
    leaves eligible; none when the weights are never normalised) and the kept renormalisation."""
    k, r = model_cfg.moe.top_k, model_cfg.moe.router
    E = r.topk_groups * (ExpertSlots.from_config(model_cfg.moe).selectable // r.n_groups)
    rows: list[Setting] = [(None, None, "mass")]
    for k1 in range(1, k):
        if normalises(model_cfg):
            rows += [(k1, k2, "mass") for k2 in sorted({k1, k, 2 * k}) if k2 <= E]
        else:
            rows.append((k1, None, "mass"))
        rows.append((k1, None, "kept"))
    return rows


def describe(model_cfg: ModelConfig, served: ModelConfig, setting: Setting) -> dict[str, Any]:
    """What a row ran: K1, the weights' denominator K2 (None: not normalised), and the rule."""
    k1, k2, renorm = setting
    K1 = served.moe.top_k
    rule = "trained" if served == model_cfg else renorm
    K2 = weight_denominator(served)
    return {"k1": K1, "k2": K2, "renorm": rule, "trained_k": model_cfg.moe.top_k}


@torch.no_grad()
def evaluate(model: MoEModel, cfg: RunConfig, windows: Windows, dtype: str, max_batches: int | None
             ) -> tuple[float, float, int]:
    """(validation loss, mean over tokens and MoE layers of the sum of the run experts' combine
    weights, tokens evaluated)."""
    sums: list[torch.Tensor] = []
    counts: list[int] = []

    def keep(_module: torch.nn.Module, _inputs: Any, decision: RoutingDecision) -> None:
        sums.append(decision.weights_TK.sum(-1).double().sum())
        counts.append(decision.weights_TK.shape[0])

    hooks = [layer.router.register_forward_hook(keep) for layer in model.moe_layers()]
    try:
        loss = val_loss(model, cfg, windows, dtype=dtype, max_batches=max_batches)
    finally:
        for h in hooks:
            h.remove()
    n_layers = max(len(hooks), 1)
    wsum = float(torch.stack(sums).sum()) / sum(counts) if sums else float("nan")
    return loss, wsum, sum(counts) // n_layers


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| K1 (experts run) | K2 (weight denominator) | rule | val loss (nats/byte) | vs trained | "
             "mean sum of run weights |", "|---|---|---|---|---|---|"]
    base = rows[0]["val_loss"]
    for r in rows:
        k2 = "-" if r["k2"] is None else str(r["k2"])
        delta = r["val_loss"] - base
        lines.append(f"| {r['k1']} | {k2} | {' = '.join(r['names'])} | {r['val_loss']:.4f} | "
                     f"{delta:+.4f} ({100 * delta / base:+.1f}%) | {r['weight_sum']:.3f} |")
    return "\n".join(lines)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Written atomically (atomic.py): a failed run leaves nothing."""
    atomic.write_text(path, json.dumps(data, indent=2) + "\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dropless evaluate",
                                description="Validation loss of a trained run, with fewer experts if asked.")
    p.add_argument("--run-dir", required=True)
    add_serving_args(p)
    p.add_argument("--serve-sweep", action="store_true",
                   help="evaluate the trained k and each K1 < k with K2 in {K1, k, 2k} and kept "
                        "renormalisation; print a markdown table")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="autocast dtype of the forward")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--max-batches", type=int, default=None,
                   help="validation batches (default: the run's train.eval_batches)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.max_batches is not None and args.max_batches < 1:
        raise ValueError(f"--max-batches={args.max_batches}: must be >= 1")
    if args.json is not None and not args.json.parent.is_dir():
        raise ValueError(f"--json={str(args.json)!r}: directory {str(args.json.parent)!r} does not exist")
    if args.serve_sweep and (args.serve_top_k is not None or args.serve_norm_top_k is not None
                             or args.serve_renorm != "mass"):
        raise ValueError("--serve-sweep: runs its own --serve-top-k/--serve-norm-top-k/--serve-renorm "
                         "settings; give none of them with it")
    cfg, ckpt_path = run_config(args.run_dir)
    trained = cfg.model
    if args.serve_sweep:
        settings = sweep_settings(trained)
    else:
        settings = [(args.serve_top_k, args.serve_norm_top_k, args.serve_renorm)]
    # every setting is checked before the first (slow) evaluation
    served_cfgs = []
    for k1, k2, renorm in settings:
        fn = serving_map(k1, k2, renorm)
        served_cfgs.append(trained if fn is None else serving_top_k(trained, k1, k2, renorm))
    device = resolve_device(args.device)[0]
    windows = val_windows(cfg)
    rows: list[dict[str, Any]] = []
    seen: dict[str, dict[str, Any]] = {}
    bar = tqdm(list(zip(settings, served_cfgs)), desc="evaluate", file=sys.stderr,
               disable=len(settings) == 1)
    for setting, served in bar:
        row = describe(trained, served, setting)
        key = json.dumps(to_dict(served), sort_keys=True)
        if key in seen:  # the same model under another name (mass K2 = K1 is kept renormalisation)
            if row["renorm"] not in seen[key]["names"]:
                seen[key]["names"].append(row["renorm"])
            continue
        model, run_cfg = load_model(args.run_dir, device, model_cfg=lambda _m, s=served: s)
        loss, wsum, n_tokens = evaluate(model, run_cfg, windows, args.dtype, args.max_batches)
        row.update(names=[row["renorm"]], val_loss=loss, weight_sum=wsum, tokens=n_tokens)
        seen[key] = row
        rows.append(row)
        del model
    r = trained.moe.router
    return {
        "run_dir": str(args.run_dir), "checkpoint": str(ckpt_path), "dtype": args.dtype,
        "device": str(device), "max_batches": args.max_batches or cfg.train.eval_batches,
        "trained": {"top_k": trained.moe.top_k, "num_experts": trained.moe.num_experts,
                    "score_func": r.score_func, "pre_softmax": r.pre_softmax,
                    "renormalize": r.renormalize, "scaling_factor": r.scaling_factor,
                    "n_groups": r.n_groups, "topk_groups": r.topk_groups,
                    "use_expert_bias": r.use_expert_bias},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        out = run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless evaluate: error: {err}", file=sys.stderr)
        return 2
    out["command"] = "dropless evaluate " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = out["rows"]
    if args.serve_sweep:
        print(markdown(rows))
    else:
        r = rows[0]
        k2 = "-" if r["k2"] is None else r["k2"]
        print(f"val_loss {r['val_loss']:.6f} nats/token (K1={r['k1']}, K2={k2}, rule={r['renorm']}, "
              f"trained k={r['trained_k']}; mean sum of run weights {r['weight_sum']:.4f}; "
              f"dtype {args.dtype}, {r['tokens']} tokens)")
    if args.json is not None:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
