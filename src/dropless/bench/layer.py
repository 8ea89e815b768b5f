"""`dropless bench layer`: the whole MoE layer (router to combine), forward and forward+backward.

Legend: T tokens, D model width, E experts, K experts per token, F expert width, P = T*K pairs.

Variants (all timed in turns, see bench/timing.py):
- dropless          MoELayer's default path: plan, gather, grouped_mm experts, weighted gather back.
- dense_same_shape  the ceiling: all P rows through ONE expert's weights with plain mm, same GEMM
                    shapes and FLOPs, no router, no permutation, no combine. ratio_to_dense =
                    dense_same_shape fwd+bwd time / variant fwd+bwd time (1.0 is the ceiling).
- dense_wide        a dense SwiGLU MLP of width K*F on the T tokens (the same FLOPs without the K-fold
                    row copy; for information).
- loop_reference    MoELayer with backend="loop" (per-expert matmuls; the reference path).
- padded_capacity   capacity mode (padded_bmm) with the smallest factor that drops nothing for this
                    routing (C = the largest expert load, computed once at setup).
- hf_transformers   transformers' Qwen3MoeSparseMoeBlock with its grouped_mm experts, fed the same
                    expert ids (see bench/hf_baseline.py); only when transformers is importable.

Routing is forced, not learned, so that every variant computes the same pairs:
- balanced: every expert gets exactly P/E pairs, K distinct experts per token (each block of E/K
  tokens takes one random permutation of the experts, cut into K-sized pieces).
- skewed: Zipf-like, p_e proportional to 1/(rank_e + 1)^1.0 with a random rank per expert; each token
  draws K distinct experts with torch.multinomial (without replacement), fixed seed.
The ids go in through `layer(x, replay_ids=ids)`: the router still computes the weights at those ids
and still receives gradients.

Parameters are in the bench dtype (the router stays fp32, as the model keeps it); fwd runs under
no_grad; fwd+bwd is forward, loss = y.float().square().mean(), backward with grads on x and every
parameter (grads reset to None before each call, so no accumulation cost is timed).

Device: `--device cpu` (the default) or `cuda`. Routing ids and inputs are drawn on the CPU with a
seeded generator and moved, so both devices time the same pairs; CUDA timings synchronise the device
around each call (bench/timing.py).

Threads: `--threads 1` is the stable setting on a shared machine. The CPU grouped_mm runs one small
matmul per expert, each its own parallel region; when other processes deschedule one of torch's
threads, every region waits for it, so with 2 threads on a busy 2-core machine the grouped variants
(dropless, hf_transformers) lose far more than the few-big-GEMM dense variants (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Callable, Collection, NamedTuple

import torch
from torch.profiler import record_function

from .. import atomic
from ..config import MoEConfig
from ..layers.mlp import MLP
from ..layers.moe import MoELayer
from ..ops.capacity_plan import capacity
from ..ops.activations import weighted_swiglu
from . import hf_baseline
from .timing import format_table, interleaved

# name: (T, D, E, K, F). "tiny" is for the smoke test only.
SHAPES = {
    "tiny": (64, 32, 8, 2, 16),
    "small": (4096, 512, 64, 8, 256),
    "medium": (4096, 1024, 64, 8, 512),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ZIPF_EXPONENT = 1.0
COLUMNS = ["variant", "fwd_ms", "fwd_bwd_ms", "ratio_to_dense"]
VARIANTS = ("dropless", "dropless@balanced", "dense_same_shape", "dense_wide", "loop_reference",
            "padded_capacity", "hf_transformers")
# (fwd, fwd_bwd) closures of one variant
Variant = tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor | None]]


def balanced_ids(T: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    if (T * K) % E or E % K:
        raise ValueError(f"balanced routing needs E | T*K and K | E (T={T}, E={E}, K={K})")
    perms = torch.rand(T * K // E, E, generator=gen).argsort(dim=-1)  # one permutation per E/K tokens
    return perms.reshape(T, K)


def skewed_ids(T: int, E: int, K: int, gen: torch.Generator, exponent: float = ZIPF_EXPONENT) -> torch.Tensor:
    rank_E = torch.randperm(E, generator=gen)
    p_E = (rank_E + 1.0).pow(-exponent)
    return torch.multinomial(p_E.expand(T, E), K, replacement=False, generator=gen)


def max_vio(ids_TK: torch.Tensor, E: int) -> float:
    load_E = torch.bincount(ids_TK.reshape(-1), minlength=E).float()
    return float(load_E.max() / load_E.mean() - 1)


def _params(*modules: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for m in modules for p in m.parameters()]


# The closures return what they computed (the output; the input gradient), which timing ignores, so
# that tests/test_bench_layer.py can check that the variants compute the same function.
# `marks`: profiler labels for the forward and the backward (op_count.py counts the ops under each).
def _fwd_bwd(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
             params: list[torch.nn.Parameter],
             marks: tuple[str, str] | None = None) -> Callable[[], torch.Tensor | None]:
    def phase(i: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if marks is None else record_function(marks[i])

    def run() -> torch.Tensor | None:
        x.grad = None
        for p in params:
            p.grad = None
        with phase(0):
            y = forward(x)
        with phase(1):
            y.float().square().mean().backward()
        return x.grad

    return run


def _fwd(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.no_grad():
            return forward(x)

    return run


class Forward(NamedTuple):
    """One variant as a function of its input, the input leaf it takes, and the parameters it trains."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    x: torch.Tensor
    params: list[torch.nn.Parameter]


def dims(shape: str, tokens: int | None = None) -> tuple[int, int, int, int, int]:
    """(T, D, E, K, F) of a named shape, T replaced by `tokens` when given."""
    T, D, E, K, Fw = SHAPES[shape]
    if tokens is not None and tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {tokens}")
    return (tokens or T), D, E, K, Fw


def draw_inputs(shape: str, routing: str, dtype: torch.dtype, seed: int = 0, device: torch.device | str = "cpu",
                tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The input leaf x_TD (on `device`) and the forced expert ids (on the host), seeded."""
    T, D, E, K, _ = dims(shape, tokens)
    gen = torch.Generator().manual_seed(seed)
    host_ids_TK = balanced_ids(T, E, K, gen) if routing == "balanced" else skewed_ids(T, E, K, gen)
    x_TD = torch.randn(T, D, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
    return x_TD, host_ids_TK


def moe_layer(shape: str, dtype: torch.dtype, seed: int = 0, device: torch.device | str = "cpu",
              **kw) -> MoELayer:
    """The bench's MoE layer: same weights for every seed (drawn on the CPU, then moved), router fp32."""
    _, D, E, K, Fw = SHAPES[shape]
    torch.manual_seed(seed)
    layer = MoELayer(D, MoEConfig(num_experts=E, top_k=K, d_expert=Fw, **kw))
    layer.to(device=device, dtype=dtype)
    layer.router.float()
    return layer


def build_forwards(shape: str, routing: str, dtype: torch.dtype, seed: int = 0,
                   device: torch.device | str = "cpu", only: Collection[str] | None = None,
                   tokens: int | None = None) -> tuple[dict[str, Forward], dict]:
    """Every variant (or those named in `only`) as a Forward, plus metadata about the routing."""
    T, D, E, K, Fw = dims(shape, tokens)
    x_TD, host_ids_TK = draw_inputs(shape, routing, dtype, seed, device, tokens)
    ids_TK = host_ids_TK.to(device)  # the setup statistics below read host_ids_TK

    def moe(**kw) -> MoELayer:
        return moe_layer(shape, dtype, seed, device, **kw)

    def want(name: str) -> bool:
        return only is None or name in only

    forwards: dict[str, Forward] = {}

    def add(name: str, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
            params: list[torch.nn.Parameter]) -> None:
        forwards[name] = Forward(forward, x, params)

    dropless = moe()  # always built: the other variants copy its weights
    if want("dropless"):
        add("dropless", lambda x: dropless(x, replay_ids=ids_TK).y, x_TD, _params(dropless))
    if routing == "skewed" and want("dropless@balanced"):
        # The same layer under balanced routing, timed in the same turns: skewed / balanced time of
        # the dropless path is then a ratio within one run, not across two runs on a noisy machine.
        bal_TK = balanced_ids(T, E, K, torch.Generator().manual_seed(seed)).to(device)
        add("dropless@balanced", lambda x: dropless(x, replay_ids=bal_TK).y, x_TD, _params(dropless))

    if want("dense_same_shape"):
        # The ceiling: P rows (a leaf of their own, so no gather is timed) through expert 0's weights;
        # the same SwiGLU op as the experts; the K rows of a token are summed (a contiguous reduction,
        # no weights) so that the loss is taken over T x D values as in every other variant.
        w1_DF = dropless.experts.w_gate_up_EDF[0].detach().clone().requires_grad_(True)
        w2_FD = dropless.experts.w_down_EFD[0].detach().clone().requires_grad_(True)
        x_PD = x_TD.detach().repeat_interleave(K, dim=0).requires_grad_(True)
        add("dense_same_shape", lambda x: (weighted_swiglu(x @ w1_DF) @ w2_FD).view(T, K, D).sum(1),
            x_PD, [w1_DF, w2_FD])

    if want("dense_wide"):
        wide = MLP(D, K * Fw).to(device=device, dtype=dtype)
        add("dense_wide", wide, x_TD, _params(wide))

    if want("loop_reference"):
        loop = moe(backend="loop")
        add("loop_reference", lambda x: loop(x, replay_ids=ids_TK).y, x_TD, _params(loop))

    # Smallest factor whose capacity C = ceil(factor * P / E) equals the largest load: drops nothing.
    max_load = int(torch.bincount(host_ids_TK.reshape(-1), minlength=E).max())
    factor = max_load * E / (T * K)
    while capacity(T, K, E, factor) < max_load:
        factor *= 1 + 1e-9
    if want("padded_capacity"):
        padded = moe(capacity_factor=factor)
        add("padded_capacity", lambda x: padded(x, replay_ids=ids_TK).y, x_TD, _params(padded))

    meta = {"shape": shape, "T": T, "d": D, "E": E, "k": K, "f": Fw, "routing": routing,
            "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "max_vio": max_vio(host_ids_TK, E),
            "capacity_factor": factor,
            "zipf_exponent": ZIPF_EXPONENT if routing == "skewed" else None}
    if hf_baseline.available() and want("hf_transformers"):
        block = hf_baseline.build_block(dropless, ids_TK, dtype).to(device)
        if not hf_baseline.uses_grouped_mm(block, x_TD.detach()):
            raise RuntimeError("the transformers block did not run grouped_mm; refusing to time it")
        with torch.no_grad():  # same weights and routing: the outputs must agree to bf16 noise
            y_hf = block(x_TD.unsqueeze(0)).squeeze(0).float()
            y_ours = dropless(x_TD, replay_ids=ids_TK).y.float()
        meta["hf_rel_diff"] = float((y_hf - y_ours).norm() / y_ours.norm())
        add("hf_transformers", lambda x: block(x.unsqueeze(0)).squeeze(0), x_TD, _params(block))
    return forwards, meta


def build_variants(shape: str, routing: str, dtype: torch.dtype, seed: int = 0,
                   device: torch.device | str = "cpu"
                   ) -> tuple[dict[str, Variant], dict]:
    """Every variant as (fwd, fwd_bwd) closures, plus metadata about the routing."""
    forwards, meta = build_forwards(shape, routing, dtype, seed, device)
    return {name: (_fwd(f.fn, f.x), _fwd_bwd(f.fn, f.x, f.params)) for name, f in forwards.items()}, meta


def run(shape: str, routing: str, dtype: torch.dtype, repeats: int, warmup: int,
        skip: tuple[str, ...] = (), device: torch.device | str = "cpu") -> tuple[list[dict], dict]:
    variants, meta = build_variants(shape, routing, dtype, device=device)
    variants = {name: fns for name, fns in variants.items() if name not in skip}
    fns = {}
    for name, (fwd, fwd_bwd) in variants.items():
        fns[f"{name}/fwd"] = fwd
        fns[f"{name}/fwd_bwd"] = fwd_bwd

    def progress(rep: int) -> None:
        print(f"\r  {shape}/{routing}: repeat {rep + 1}/{repeats}", end="", file=sys.stderr, flush=True)

    print(f"  {shape}/{routing}: warm-up ({warmup} rounds of {len(fns)} timings)", file=sys.stderr, flush=True)
    ms = interleaved(fns, repeats, warmup, device=device, progress=progress)
    print(file=sys.stderr)
    dense = ms["dense_same_shape/fwd_bwd"]
    if "dropless@balanced" in variants:
        meta["skew_slowdown"] = ms["dropless/fwd_bwd"] / ms["dropless@balanced/fwd_bwd"]
    rows = [{"variant": name, "fwd_ms": ms[f"{name}/fwd"], "fwd_bwd_ms": ms[f"{name}/fwd_bwd"],
             "ratio_to_dense": dense / ms[f"{name}/fwd_bwd"], **meta} for name in variants]
    return rows, meta


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """--shape, --routing, --dtype: the layer benches' common choices."""
    ap.add_argument("--shape", choices=["small", "medium", "tiny"], default="small",
                    help="small: T=4096 d=512 E=64 k=8 f=256; medium: T=4096 d=1024 E=64 k=8 f=512")
    ap.add_argument("--routing", choices=["balanced", "skewed"], default="balanced")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dropless bench layer", description=__doc__.split("\n")[0])
    add_shape_args(ap)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma-separated variants not to time (e.g. loop_reference, "
                    "the slowest by far); dense_same_shape is always timed")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--count-ops", action="store_true",
                    help="count ATen ops per forward + backward (torch profiler) instead of timing; "
                         "see bench/op_count.py")
    ap.add_argument("--tokens", type=int, help="with --count-ops: T instead of the shape's (the ops "
                    "counted on the GPU path do not depend on T; a CPU profile of fewer tokens is faster)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("dropless bench layer: error: --device cuda: CUDA is not available to this torch", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = tuple(v for v in args.skip.split(",") if v and v != "dense_same_shape")
    device = torch.device(args.device)
    if args.count_ops:
        return _count_ops(args, skip, device)
    if args.tokens is not None:
        print("dropless bench layer: error: --tokens is for --count-ops; timings use the shape's T",
              file=sys.stderr)
        return 2
    rows, meta = run(args.shape, args.routing, DTYPES[args.dtype], args.repeats, args.warmup, skip, device)
    T, D, E, K, Fw = SHAPES[args.shape]
    where = (f"device={torch.cuda.get_device_name(device)}" if device.type == "cuda"
             else f"threads={torch.get_num_threads()}")
    print(f"layer bench: {args.shape} (T={T} d={D} E={E} k={K} f={Fw}), routing={args.routing} "
          f"(MaxVio {meta['max_vio']:.3f}), dtype={args.dtype}, {where}, median of {args.repeats}")
    print(format_table(rows, COLUMNS))
    if "skew_slowdown" in meta:
        print(f"dropless fwd+bwd, skewed / balanced routing (same run): {meta['skew_slowdown']:.3f}")
    if "hf_rel_diff" in meta:
        print(f"hf_transformers vs dropless output, relative L2 difference: {meta['hf_rel_diff']:.2e}")
    _write_json(args.json, rows)
    return 0


def _write_json(path: str | None, rows: list[dict]) -> None:
    if path:
        with atomic.atomic_write(path, "w") as fh:
            json.dump(rows, fh, indent=1)


def _count_ops(args: argparse.Namespace, skip: tuple[str, ...], device: torch.device) -> int:
    """`--count-ops`: the ATen ops of one forward + backward per variant (bench/op_count.py)."""
    from . import op_count

    forwards, _ = build_forwards(args.shape, args.routing, DTYPES[args.dtype], device=device,
                                 only={v for v in VARIANTS if v not in skip}, tokens=args.tokens)
    rows, counts = op_count.count_variants(
        {name: _fwd_bwd(f.fn, f.x, f.params, op_count.MARKS) for name, f in forwards.items()})
    T, D, E, K, Fw = dims(args.shape, args.tokens)
    print(f"op count: {args.shape} (T={T} d={D} E={E} k={K} f={Fw}), routing={args.routing}, "
          f"dtype={args.dtype}, device={device.type}: top-level ATen ops of one forward and one backward "
          "(the loss y.float().square().mean() and its backward included alike)")
    print(op_count.format_rows(rows))
    for row in rows:
        row["forward_by_op"] = dict(counts[row["variant"]].forward)
        row["backward_by_op"] = dict(counts[row["variant"]].backward)
    _write_json(args.json, rows)
    return 0
