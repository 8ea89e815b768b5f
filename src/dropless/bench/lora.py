"""`dropless bench lora`: LoRA training on the CPU, dropless against transformers + peft, one process each.

    dropless bench lora --hf-dir DIR [--batch 4] [--seq 256] [--warmup 2] [--steps 3] [--rank 16]
                        [--alpha 32] [--threads 2] [--dtype auto|fp32|bf16] [--malloc system|native|keep]
                        [--json FILE]
    dropless bench lora --quick      (a tiny Qwen3-MoE checkpoint made on the spot: the test's mode)

DIR is a Qwen3-MoE checkpoint; the published shapes cut to a few layers come from
`python -m dropless.bench.hf_shapes qwen3_30b_a3b --layers 2 --out DIR` (1.87B parameters, 7.5 GB
in fp32, most of it the 2 x 128 experts and the 151936-token embedding and head).

Both sides adapt the same weights with rank r, alpha: attention (q|k|v and the output) and every routed
expert (gate|up and down); the base is frozen (fp32 as loaded); the batch, the loss and the optimizer
are the same (bench/lora_side.py). dropless: `MoEModel(cfg, lora=LoRAConfig(targets=["attn",
"experts"]))`, its experts' adapters run on the grouped path's offsets (ops/lora_experts.py). peft:
`LoraConfig(target_modules=[q,k,v,o]_proj, target_parameters=[mlp.experts.gate_up_proj,
mlp.experts.down_proj])` on transformers' Qwen3MoeForCausalLM (bench/lora_peft.py).

Each side runs in a process of its own, one after the other (never two models in memory at once),
so each peak is that library's alone. The dropless side goes first: it initialises the adapters
(B nonzero) and saves them; the peft side starts from the same values in its own layout. The
equivalence, on the first step (the same function of the same weights on both sides): the losses,
the logits of the first PROBE positions, and every adapter's gradient (peft's mapped back to
dropless's adapters) agree within RTOL; and, after the timed steps, peft's own `get_delta_weight`
of every expert parameter equals dropless's per-expert update. The exit status is 1 when any of
them fails. The steps after the first move the two apart by design (peft trains q, k and v's A
separately, dropless one shared A): the last losses are close, not equal.

`--malloc`: how glibc keeps freed memory, which moves the resident set (cpu_alloc.py). system
(default): glibc's defaults on both sides, so the comparison is of the libraries alone. native: each
side as its library runs it, dropless with `cpu_alloc.keep_freed_memory` (what every `dropless`
command does), peft with glibc's defaults (a plain transformers script); keep: both kept. At the
Qwen3-30B-A3B shape keeping freed memory costs the dropless side 1.1-2.7 GiB of peak for no measurable
speed (docs/benchmarks.md): a LoRA step allocates no [E, D, 2F] weight gradient to reuse.

`--dtype auto` is `train.dtype=auto` (device.py): bf16 autocast on CPUs with AMX, fp32 elsewhere;
both sides run the forward under it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from .. import atomic
from ..device import resolve
from . import lora_side
from .load_memory import gib
from .lora_side import PROBE
from .timing import format_table
from .timing import cpu_flags

# The first step's agreement, relative to the largest dropless value: the same function of the same
# weights in other kernels (fused q|k|v vs three projections, grouped adapters vs the update folded into
# the weight, two attention kernels), so in fp32 a few ulps of what each element sums. Measured (quick
# shape / the 2-layer Qwen3-30B-A3B shape): loss 0 / 0 (bit-equal: a mean over B S tokens), logits
# 3.0e-7 / 4.7e-7, gradients 6.0e-7 / 1.1e-6 (a gradient element sums over every routed row, with
# cancellation, so it is held to the largest element of its tensor, not to itself). A misplaced block
# is far outside: two experts' B swapped moves the quick loss by 4.9e-4 and the gradients by 1.4, k's
# and v's rows of B swapped the loss by 2.7e-3, the shared A's gradient taken from q alone 0.92.
# bf16 autocast: the libraries round at different points (peft folds the expert update and runs its
# experts in fp32; dropless runs them in bf16); measured at the quick shape only (this CPU has no AMX)
# loss 3.6e-5, logits 8.5e-3, gradients 1.2e-2: the bounds are about 8x those.
RTOL = {"fp32": {"loss": 1e-5, "logits": 1e-5, "grads": 1e-4}, "bf16": {"loss": 3e-4, "logits": 5e-2, "grads": 1e-1}}
# the glibc tunables cpu_alloc.keep_freed_memory exports to child processes (removed for the sides:
# each applies its own --malloc mode)
MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
MALLOC_MODES = {"system": {"dropless": "system", "peft": "system"}, "native": {"dropless": "keep", "peft": "system"},
                "keep": {"dropless": "keep", "peft": "keep"}}
SIDES = ("dropless", "peft")
COLUMNS = ["side", "tokens_per_s", "s_per_step", "cpu_s_per_step", "sys_s_per_step", "rss_loaded", "load_peak", "train_peak",
           "process_peak", "load_s", "trainable", "first_loss", "last_loss", "malloc"]
# dropless / peft: ratio of each figure (the issue's targets: tokens/s >= 1.5, peak RSS <= 0.65)
TARGETS = {"tokens_per_s": 1.5, "process_peak": 0.65, "train_peak": 0.65}


def quick_checkpoint(out: Path) -> Path:
    """A 2-layer Qwen3-MoE of tiny widths (d 64, E 8, k 2, f 32, V 512), written as hf_shapes writes
    the published shapes."""
    from . import hf_shapes

    cfg = hf_shapes._transformers().Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
    return hf_shapes.write(cfg, out)


def _child_env() -> dict[str, str]:
    """This environment without MALLOC_ENV (each side applies its own --malloc mode) and this
    dropless first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_side(side: str, spec: lora_side.Spec, malloc: str, work: Path) -> dict:
    spec_path, out_path = work / f"{side}.spec.json", work / f"{side}.out.json"
    spec_path.write_text(json.dumps({**asdict(spec), "malloc": malloc}))
    print(f"bench lora: running the {side} side (its own process)", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "dropless.bench.lora_side", side, str(spec_path), str(out_path)],
                          env=_child_env(), stdout=subprocess.DEVNULL)
    if proc.returncode:
        why = (f"killed by signal {-proc.returncode} (out of memory? reduce --batch or --seq)"
               if proc.returncode < 0 else f"exit status {proc.returncode} (its error is above)")
        raise RuntimeError(f"the {side} side failed: {why}")
    return {**json.loads(out_path.read_text()), "malloc": malloc}


def compare(sides: dict[str, dict], dtype: str) -> dict:
    """Ratios dropless / peft, the targets, and the equivalence of the first step."""
    d, p = sides["dropless"], sides["peft"]
    ratios = {k: d[k] / p[k] for k in TARGETS}
    met = {k: (ratios[k] >= t if k == "tokens_per_s" else ratios[k] <= t) for k, t in TARGETS.items()}
    diff = abs(d["losses"][0] - p["losses"][0])
    rel = diff / abs(d["losses"][0])
    tol = RTOL[dtype]
    first = p["first_step"]
    checks = {"loss": (rel, tol["loss"]), "logits": (first["logits_rel_diff"], tol["logits"]),
              "grads": (first["grad_rel_diff"], tol["grads"]),
              "delta": (p["delta_check"]["max_rel_diff"], p["delta_check"]["rtol"])}
    passed = {k: v <= t for k, (v, t) in checks.items()}
    return {"ratios": ratios, "targets": TARGETS, "met": met,
            "first_step": {"loss_dropless": d["losses"][0], "loss_peft": p["losses"][0], "loss_abs_diff": diff,
                           **first},
            "checks": {k: {"rel_diff": v, "rtol": t, "passed": passed[k]} for k, (v, t) in checks.items()},
            "delta_check": p["delta_check"], "equivalent": all(passed.values())}


def rows(sides: dict[str, dict]) -> list[dict]:
    out = []
    for name, r in sides.items():
        figures = ("tokens_per_s", "s_per_step", "cpu_s_per_step", "sys_s_per_step", "load_s", "trainable", "malloc")
        out.append({"side": name, **{k: r[k] for k in figures},
                    **{k: gib(r[k]) for k in ("rss_loaded", "load_peak", "train_peak", "process_peak")},
                    "first_loss": f"{r['losses'][0]:.6f}", "last_loss": f"{r['losses'][-1]:.6f}"})
    return out


def report(sides: dict[str, dict], cmp: dict, meta: dict) -> str:
    d, p = sides["dropless"], sides["peft"]
    lines = [f"lora bench: Qwen3-MoE {d['n_layers']} layers, d={d['d_model']} E={d['num_experts']} "
             f"k={d['top_k']} f={d['d_expert']} V={d['vocab']}; batch {meta['batch']} x seq {meta['seq']}; "
             f"rank {meta['rank']} alpha {meta['alpha']} on attn + experts; {meta['dtype']} ({meta['dtype_reason']})",
             f"threads {d['threads']} (both); CPU flags: {meta['cpu_flags']}; torch {torch.__version__}, "
             f"transformers {p['transformers']}, peft {p['peft']}; {meta['warmup']} warm-up + median of "
             f"{meta['steps']} steps",
             f"experts kernels: dropless backend {d['experts_backend']} {d['grouped_ops'] or '(no grouped_mm op)'}; "
             f"transformers experts_implementation={p['experts_implementation']} "
             f"{p['grouped_ops'] or '(no grouped_mm op)'}, attention {p['attn_implementation']}",
             "", format_table(rows(sides), COLUMNS), ""]
    r, met = cmp["ratios"], cmp["met"]
    lines.append("dropless / peft: " + ", ".join(
        f"{k} {r[k]:.2f}x (target {'>=' if k == 'tokens_per_s' else '<='} {TARGETS[k]}: "
        f"{'met' if met[k] else 'NOT met'})" for k in TARGETS))
    first, checks, delta = cmp["first_step"], cmp["checks"], cmp["delta_check"]

    def said(k: str) -> str:
        c = checks[k]
        return f"{c['rel_diff']:.2e} (rtol {c['rtol']:g}{'' if c['passed'] else ', FAILED'})"

    lines += [f"equivalence (first step, same adapters, B nonzero): loss dropless {first['loss_dropless']:.7f} "
              f"peft {first['loss_peft']:.7f}, |diff| {first['loss_abs_diff']:.2e}, relative {said('loss')}; "
              f"logits of {PROBE} positions, max |diff| / max |logit| {said('logits')}",
              f"  gradients of all {first['grads_compared']} dropless adapters (peft's mapped back), worst "
              f"max |diff| / max |grad| {said('grads')} at {first['grad_worst']}; peft get_delta_weight of "
              f"{delta['params']} expert parameters vs dropless's per-expert (a b s)^T {said('delta')} -> "
              f"{'PASSED' if cmp['equivalent'] else 'FAILED'}"]
    return "\n".join(lines)


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dropless bench lora", description=__doc__.split("\n")[0])
    ap.add_argument("--hf-dir", help="a Qwen3-MoE checkpoint folder (see the module note)")
    ap.add_argument("--quick", action="store_true", help="a tiny checkpoint made on the spot (tests)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; quick 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256; quick 16)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 2: the first is the check, the last profiled)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (the median is reported)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads, the same on both sides")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--malloc", default="system", choices=list(MALLOC_MODES),
                    help="glibc's handling of freed memory per side (module note)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the settings, both sides' figures and the comparison here")
    args = ap.parse_args(argv)
    if args.quick == bool(args.hf_dir):
        raise ValueError("give --hf-dir DIR or --quick (one of them)")
    if args.hf_dir and not Path(args.hf_dir, "config.json").is_file():
        raise ValueError(f"--hf-dir {args.hf_dir}: no config.json")
    args.batch = args.batch or (2 if args.quick else 4)
    args.seq = args.seq or (16 if args.quick else 256)
    for name, low in (("batch", 1), ("seq", 2), ("warmup", 2), ("steps", 1), ("rank", 1), ("threads", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name} {getattr(args, name)}: must be >= {low}")
    return args


def main(argv: list[str]) -> int:
    try:
        args = _parse(argv)
    except ValueError as err:
        print(f"dropless bench lora: error: {err}", file=sys.stderr)
        return 2
    placement = resolve(torch.device("cpu"), args.dtype)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        work = Path(tmp)
        hf_dir = quick_checkpoint(work / "ckpt") if args.quick else Path(args.hf_dir).absolute()
        spec = lora_side.Spec(hf_dir=str(hf_dir), rank=args.rank, alpha=args.alpha, batch=args.batch, seq=args.seq,
                              warmup=args.warmup, steps=args.steps, threads=args.threads, lr=args.lr,
                              seed=args.seed, dtype=placement.dtype, work=str(work))
        sides = {s: run_side(s, spec, MALLOC_MODES[args.malloc][s], work) for s in SIDES}
    cmp = compare(sides, placement.dtype)
    meta = {**vars(args), "hf_dir": str(hf_dir), "dtype": placement.dtype, "dtype_reason": placement.dtype_reason,
            "cpu_flags": cpu_flags(), "torch": torch.__version__}
    print(report(sides, cmp, meta))
    if args.json:
        atomic.write_text(args.json, json.dumps({"meta": meta, "sides": sides, "comparison": cmp}, indent=1))
    return 0 if cmp["equivalent"] else 1
