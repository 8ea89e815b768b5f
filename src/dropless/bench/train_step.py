"""`dropless bench train`: one whole training step of a Qwen3-MoE model, dropless against transformers.

Legend: B batch, S sequence, D model width, E experts, K experts per token, F expert width, V vocabulary.

    dropless bench train --family qwen3_moe --shape small|medium [--json FILE] [--threads N]
                         [--steps N] [--device cpu|cuda] [--dtype auto|bf16|fp32]

One step = forward, loss, backward, AdamW step, zero_grad, on the same model (same weights) and the
same batch for every row, timed in turns (bench/timing.py: warm-up rounds first, then the median of
`--steps` interleaved rounds):
- dropless           MoEModel as the trainer runs it: the forward under the run's autocast,
                     `out.loss.backward()`, the trainer's optimizer (train/optim.py: fused AdamW, no
                     decay on norms), `zero_grad(set_to_none=True)`.
- dropless_compiled  the same model and optimizer with its blocks compiled (train/compiling.py, what
                     `train.compile = true` does); the first warm-up call pays the compile, reported
                     as compile_s.
- hf_transformers    transformers' Qwen3MoeForCausalLM holding the same weights (hf/mapping.py's
                     table), its experts on the `grouped_mm` implementation (transformers 5 resolves an
                     unset `experts_implementation` to it in `get_correct_experts_implementation`; set
                     explicitly here and checked with the profiler), SDPA attention, and the step a user
                     writes: `model(input_ids, labels=input_ids).loss.backward()`,
                     `torch.optim.AdamW(model.parameters()).step()`, `zero_grad()`.
The model is built from a Qwen3-MoE config.json (as `import-hf` would read it): q/k RMSNorm,
softmax-then-top-k routing renormalised (norm_topk_prob), no z-loss; transformers' balancing loss is
on (`output_router_logits=True`, what MoE training needs) and so is dropless's (the same total at
balance, hf/mapping.py). The losses are the same function: transformers shifts its labels inside the
loss, dropless gets the shifted targets with the last position ignored (-100), so both average the
cross-entropy over the same B (S - 1) positions (tests/bench/test_bench_train.py checks the values).

dtype: both models keep fp32 weights and run their forward under the same autocast; `auto` is what
`train.dtype = auto` picks (bf16 on CUDA and AMX CPUs, fp32 elsewhere). Under bf16 autocast
transformers' grouped_mm casts its input to the weights' dtype (fp32: grouped_mm is not an autocast
op), so its experts run in fp32 where dropless's run in bf16; that is each library's behaviour under
the same autocast, and the table says which dtype it shows.

The split (share of the step): one extra step per row under torch.profiler, after the timing, with
"moe" / "attention" ranges around every MoE layer and attention module and an "optimizer" range
around step + zero_grad; backward ops are charged to the part whose forward created them
(bench/step_profile.py says how). The compiled row runs each block as one graph: its moe/attention
shares are not separable and are left empty.

Timing: wall time and this process's CPU time per step, both reported (`_interleaved`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from .. import atomic
from ..config import TrainConfig
from ..layers.moe import MoELayer
from ..model import Attention, MoEModel
from ..train import compiling
from ..device import resolve
from ..train.optim import build_optimizer
from . import hf_baseline, step_profile
from .timing import cpu_flags, format_table, sync
from .train_models import SHAPES, Shape, batch, build_hf, model_config


ROWS = ("dropless", "dropless_compiled", "hf_transformers")
COLUMNS = ["variant", "tokens_per_s", "ms_per_step", "vs_hf", "cpu_ms_per_step", "cpu_vs_hf", "moe_share",
           "attention_share", "optimizer_share", "compile_s"]


@dataclass
class Bench:
    shape: Shape
    device: torch.device
    dtype: str  # "bf16" | "fp32": the autocast of both models' forward
    model: MoEModel
    optimizer: torch.optim.Optimizer
    compiled: compiling.CompiledBlocks | None
    hf: nn.Module | None
    hf_optimizer: torch.optim.Optimizer | None
    tokens_BS: torch.Tensor
    targets_BS: torch.Tensor

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def dropless_loss(self) -> torch.Tensor:
        with self.autocast():
            return self.model(self.tokens_BS, self.targets_BS).loss

    def hf_loss(self) -> torch.Tensor:
        with self.autocast():
            return self.hf(input_ids=self.tokens_BS, labels=self.tokens_BS).loss

    def steps(self) -> dict[str, Callable[[], object]]:
        """One training step per row (module note)."""
        def dropless(compiled: bool) -> Callable[[], None]:
            def step() -> None:
                if self.compiled is not None:
                    self.compiled.enabled = compiled
                self.dropless_loss().backward()
                with torch.profiler.record_function("optimizer"):
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
            return step

        def hf() -> None:
            self.hf_loss().backward()
            with torch.profiler.record_function("optimizer"):
                self.hf_optimizer.step()
                self.hf_optimizer.zero_grad()

        out: dict[str, Callable[[], object]] = {"dropless": dropless(False)}
        if self.compiled is not None:
            out["dropless_compiled"] = dropless(True)
        if self.hf is not None:
            out["hf_transformers"] = hf
        return out


def build(shape: Shape, device: torch.device, dtype: str = "auto", rows: tuple[str, ...] = ROWS,
          backend: str | None = None, align: int = 1) -> Bench:
    """The models, optimizers and batch of one benchmark (weights seeded: the same every run)."""
    placement = resolve(device, dtype)
    torch.manual_seed(0)
    model = MoEModel(model_config(shape, align))
    hf = build_hf(model, shape).to(device) if "hf_transformers" in rows else None
    model = model.to(device)
    optimizer = build_optimizer(model, TrainConfig())
    compiled = (compiling.compile_blocks(model, device, backend)
                if "dropless_compiled" in rows else None)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=TrainConfig().lr) if hf is not None else None
    tokens_BS, targets_BS = (t.to(device) for t in batch(shape))
    return Bench(shape, device, placement.dtype, model, optimizer, compiled, hf, hf_opt, tokens_BS, targets_BS)


# ---- the profile split (bench/step_profile.py) --------------------------------------------------

def profile_row(bench: Bench, name: str, step: Callable[[], object]) -> dict[str, float | None]:
    if name == "hf_transformers":
        layers = bench.hf.model.layers
        parts = {"moe": [l.mlp for l in layers], "attention": [l.self_attn for l in layers]}
    elif name == "dropless":
        parts = {"moe": [m for m in bench.model.modules() if isinstance(m, MoELayer)],
                 "attention": [m for m in bench.model.modules() if isinstance(m, Attention)]}
    else:
        parts = {}  # compiled blocks: one graph each (module note)
    handles = step_profile.ranges(parts)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if bench.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            with torch.profiler.record_function("bench.step"):
                step()
            sync(bench.device)
    finally:
        for h in handles:
            h.remove()
    shares = step_profile.split(prof.events(), bench.device)
    if not parts:
        return {"moe_share": None, "attention_share": None, "optimizer_share": shares["optimizer"]}
    return {f"{p}_share": shares[p] for p in step_profile.PARTS}


def uses_grouped_mm(bench: Bench) -> bool:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        bench.hf_loss()
    return any("grouped_mm" in e.key for e in prof.key_averages())


# ---- running ----------------------------------------------------------------------------------------



def run(shape_name: str, device: torch.device, dtype: str, steps: int, warmup: int,
        rows: tuple[str, ...] = ROWS, progress: Callable[[str], None] | None = None,
        backend: str | None = None, align: int = 1) -> tuple[list[dict], dict]:
    shape = SHAPES[shape_name]
    say = progress or (lambda msg: None)
    say("building models")
    bench = build(shape, device, dtype, rows, backend, align)
    fns = bench.steps()
    meta: dict = {"shape": shape_name, **asdict(shape), "dtype": bench.dtype, "device": str(device),
                  "threads": torch.get_num_threads(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
                  "steps": steps, "warmup": warmup, "align": align}
    if bench.hf is not None:
        import transformers

        meta["transformers"] = transformers.__version__
        meta["hf_grouped_mm"] = uses_grouped_mm(bench)
    compile_s = None
    if "dropless_compiled" in fns:
        say("compiling the blocks (first compiled step)")
        compile_s = _seconds(fns["dropless_compiled"], device)
        if bench.compiled is not None and bench.compiled.failed is not None:
            meta["compile_failed"] = bench.compiled.failed
    elif "dropless_compiled" in rows:
        meta["compile_failed"] = "compile not attempted (see the warning)"
    say(f"timing {', '.join(fns)}: {warmup} warm-up + {steps} rounds")
    ms, cpu_ms = _interleaved(fns, steps, warmup, device, lambda rep: say(f"round {rep + 1}/{steps}"))
    tokens = shape.batch * shape.seq_len
    out = []
    for name, fn in fns.items():
        say(f"profiling {name}")
        row = {"variant": name, "tokens_per_s": tokens / (ms[name] / 1e3), "ms_per_step": ms[name],
               "cpu_ms_per_step": cpu_ms[name], **profile_row(bench, name, fn),
               "compile_s": compile_s if name == "dropless_compiled" else None}
        out.append(row)
    hf = next((r for r in out if r["variant"] == "hf_transformers"), None)
    for row in out:
        row["vs_hf"] = hf["ms_per_step"] / row["ms_per_step"] if hf else None
        row["cpu_vs_hf"] = hf["cpu_ms_per_step"] / row["cpu_ms_per_step"] if hf else None
    return out, meta


def _interleaved(fns: dict[str, Callable[[], object]], steps: int, warmup: int, device: torch.device,
                 progress: Callable[[int], None]) -> tuple[dict[str, float], dict[str, float]]:
    """bench/timing.py's round-robin, keeping two clocks per call: wall milliseconds, and this
    process's CPU milliseconds (all its threads), which on a shared, oversubscribed CPU leaves out
    the time slices other processes took (with --threads 1 it is the work done; wall is what a user
    waits). Medians over the rounds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    wall: dict[str, list[float]] = {n: [] for n in fns}
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    for rep in range(steps):
        for name, fn in fns.items():
            sync(device)
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            sync(device)
            wall[name].append((time.perf_counter() - w0) * 1e3)
            cpu[name].append((time.process_time() - c0) * 1e3)
        progress(rep)
    return ({n: statistics.median(v) for n, v in wall.items()}, {n: statistics.median(v) for n, v in cpu.items()})


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dropless bench train", description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3_moe", help="model family (qwen3_moe)")
    ap.add_argument("--shape", default="small", help="small | medium (tiny: for tests)")
    ap.add_argument("--steps", type=int, default=5, help="timed rounds (the median is reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (after the compile step)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--dtype", default="auto", help="auto | bf16 | fp32 (the autocast of both models)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to time")
    ap.add_argument("--align", type=int, default=1, help="model.moe.align of the dropless rows (default 1)")
    ap.add_argument("--json", help="write the rows and the run's settings to this file")
    args = ap.parse_args(argv)
    rows = tuple(r for r in args.rows.split(",") if r)
    try:
        _check(args, rows)
    except ValueError as err:
        print(f"dropless bench train: error: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # one tick per stage: build, compile, the warm-up, each timed round, each row's profile
    bar = tqdm(total=3 + args.steps + len(rows), desc="bench train", file=sys.stderr)

    def say(msg: str) -> None:
        bar.set_description(msg)
        bar.update(1)

    out, meta = run(args.shape, device, args.dtype, args.steps, args.warmup, rows, say, align=args.align)
    bar.close()
    s = SHAPES[args.shape]
    where = (f"device={torch.cuda.get_device_name(device)}" if device.type == "cuda"
             else f"threads={meta['threads']}, CPU flags: {meta['cpu_flags']}")
    print(f"train bench: qwen3_moe {args.shape} ({s.n_layers} layers, d={s.d_model} E={s.num_experts} "
          f"k={s.top_k} f={s.d_expert} V={s.vocab}, batch {s.batch} x seq {s.seq_len}), "
          f"autocast {meta['dtype']}, dropless model.moe.align={args.align}, {where}, median of {args.steps}")
    print(format_table(out, COLUMNS))
    if "compile_failed" in meta:
        print(f"dropless_compiled ran eager: {meta['compile_failed']}")
    if meta.get("hf_grouped_mm") is False:
        print("warning: transformers' experts did not run grouped_mm", file=sys.stderr)
    if args.json:
        atomic.write_text(args.json, json.dumps({"meta": meta, "rows": out}, indent=1))
    return 0


def _check(args: argparse.Namespace, rows: tuple[str, ...]) -> None:
    if args.family != "qwen3_moe":
        raise ValueError(f"--family {args.family!r}: only qwen3_moe is benchmarked")
    if args.shape not in SHAPES:
        raise ValueError(f"--shape {args.shape!r}: choose one of {', '.join(SHAPES)}")
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device!r}: choose cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available to this torch")
    if args.dtype not in ("auto", "bf16", "fp32"):
        raise ValueError(f"--dtype {args.dtype!r}: choose auto, bf16 or fp32")
    for name in ("steps", "threads"):
        if getattr(args, name) < (1 if name == "steps" else 0):
            raise ValueError(f"--{name} {getattr(args, name)}: must be >= {1 if name == 'steps' else 0}")
    if args.align < 1:
        raise ValueError(f"--align {args.align}: must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: must be >= 0")
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        raise ValueError(f"--rows {','.join(rows)!r}: choose from {', '.join(ROWS)}")
    if "hf_transformers" in rows and not hf_baseline.available():
        raise ValueError("--rows hf_transformers: transformers is not installed (pip install 'dropless[hf]')")
