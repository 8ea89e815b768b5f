"""`dropless bench memory`: what one MoE layer and one whole block keep for their backward pass.

Legend: T tokens, D model width, E experts, K experts per token, F expert width, B batch, S sequence.

Per variant, two scopes:
- layer: the MoE layer alone, the variants and weights of `bench layer` (bench/layer.py) on its
  shapes and forced routing;
- block: one whole decoder block (attention + norms + MoE, model.py's `Block`), the tokens as one
  sequence (B=1, S=T), H = D/64 heads (at least 1), its MoE part the same layer as in the layer scope.
  The block and its rotary tables are those of a one-block `MoEModel`: every width (heads, rotary)
  is the model's own, none is re-derived here.

Columns:
- saved_bytes_per_token: the bytes of every storage the forward keeps for the backward, divided by
  T (saved_bytes.py with count_held: what autograd saves, once per storage, parameters and buffers
  excluded, the input counted; plus what the forward created and still holds after it, which is
  how a recompute checkpoint's inputs count: it keeps them by reference, not as saved tensors).
  The output is not part of it (the next layer's input).
- peak_bytes: `torch.cuda.max_memory_allocated` over one fwd+bwd after a reset (absolute: weights,
  input and gradients included), after an untimed warm call; peak_over_start_bytes: the same less
  what was allocated before the call. The CPU allocator reports no peak: both are null there, never an estimate.
- fwd_bwd_ms: median of --repeats, every row's fwd+bwd timed in turns (bench/timing.py), as in
  `bench layer` (loss = y.float().square().mean(), grads on the input and every parameter).
- floor_bytes_per_token: the analytic floor of an MoE layer that keeps only its input and its
  expert pre-activations (the design of the fastest published MoE kernels, which re-gather rows and
  recompute the activation in backward): elem * D + elem * K * 2F for a gated activation (SwiGLU:
  the gate and up halves), elem * D + elem * K * F otherwise, D and F read from the layer's expert
  weights; bf16 medium: 2*1024 + 2*8*2*512 =
  18,432 B. The block rows carry the same figure: the floor of their MoE part only (attention,
  norms and residuals keep more), so their saved/floor ratio is not a claim about a block floor.

Variants (one line each in LAYER_VARIANTS / BLOCK_VARIANTS / DROPLESS_VARIANTS): dropless (the
default MoE layer: the lean experts, which recompute the expert activation, i.e. the `moe_act`
behaviour), dropless_keep_act (the experts' keep-everything path: `moe_act`'s cost is dropless /
dropless_keep_act), dropless_recompute_{moe,layer,attn,norm} (model.recompute with that one name;
`layer`, `attn`, `norm` in the block scope only),
hf_transformers (transformers' Qwen3-MoE sparse block, or decoder layer in the block scope; only
when transformers is importable), dense_same_shape (layer scope: the P = T*K rows through one
expert's weights, see bench/layer.py; its input leaf is the P rows, so it counts K copies of x),
and the floor row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Callable

import torch
from tqdm import tqdm

from .. import atomic
from ..config import ModelConfig, MoEConfig
from ..layers import recompute
from ..layers.moe import MoELayer
from ..model import Block, MoEModel
from ..saved_bytes import SavedBytes, saved_bytes
from . import hf_baseline
from .layer import DTYPES, _fwd_bwd, _params, add_shape_args, build_forwards, dims, draw_inputs, moe_layer
from .timing import format_table, interleaved

COLUMNS = ["scope", "variant", "saved_bytes_per_token", "saved_over_floor", "peak_bytes",
           "peak_over_start_bytes", "fwd_bwd_ms"]
HEAD_WIDTH = 64

# (name in bench/layer.py's build_forwards) of each other layer-scope variant, in table order
LAYER_VARIANTS = ("hf_transformers", "dense_same_shape")


def floor_bytes_per_token(d: int, k: int, f: int, elem_size: int, gated: bool = True) -> int:
    """Bytes per token of an MoE layer keeping only its input (d) and its K pre-activations."""
    return elem_size * d + elem_size * k * (2 * f if gated else f)


def layer_floor_bytes_per_token(layer: MoELayer, elem_size: int) -> int:
    """`floor_bytes_per_token` of `layer`, its widths read from its expert weights: the rows they
    take (D), their hidden width (F) and whether gate|up is 2F wide (a gated activation)."""
    _, d, up = layer.experts.w_gate_up_EDF.shape
    f = layer.experts.w_down_EFD.shape[1]
    return floor_bytes_per_token(d, layer.cfg.top_k, f, elem_size, gated=up == 2 * f)


@dataclasses.dataclass(frozen=True)
class Row:
    """A variant to measure: its forward, input leaf, trained parameters, constants to exclude."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    x: torch.Tensor
    params: list[torch.nn.Parameter]
    constants: tuple[torch.Tensor, ...] = ()


# dropless variants: (scope -> None or the model.recompute name, whether the experts run lean)
DROPLESS_VARIANTS: dict[str, tuple[dict[str, str | None], bool]] = {
    "dropless": ({"layer": None, "block": None}, True),
    "dropless_keep_act": ({"layer": None, "block": None}, False),
    "dropless_recompute_moe": ({"layer": "moe", "block": "moe"}, True),
    "dropless_recompute_layer": ({"block": "layer"}, True),
    "dropless_recompute_attn": ({"block": "attn"}, True),
    "dropless_recompute_norm": ({"block": "norm"}, True),
}


def _configured(layer: MoELayer, lean: bool, call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`call()` with the experts' `lean` flag set, restored to the default (True) after the forward.
    The flag is read when the experts run: in the forward, and in a recompute's backward, which only
    the lean rows have."""
    layer.experts.lean = lean
    try:
        return call()
    finally:
        layer.experts.lean = True


def _dropless_layer(layer: MoELayer, ids_TK: torch.Tensor, x_TD: torch.Tensor, mode: str | None,
                    lean: bool) -> Row:
    def run(x: torch.Tensor) -> torch.Tensor:
        if mode == "moe":  # the model's Block does the same around its MoE layer
            return recompute.recomputed_routed(lambda ids: layer(x, replay_ids=ids), ids_TK,
                                               lambda o: o.ids_TK).y
        return layer(x, replay_ids=ids_TK).y

    return Row(lambda x: _configured(layer, lean, lambda: run(x)), x_TD, _params(layer))


def _dropless_block(block: Block, ids_BSK: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor,
                    x_BSD: torch.Tensor, mode: str | None, lean: bool) -> Row:
    modes = recompute.modes_of([mode] if mode else [])

    def run(x: torch.Tensor) -> torch.Tensor:
        block.recompute = modes  # read at the call (the recompute closures capture it)
        return block(x, cos_SF, sin_SF, replay_ids=ids_BSK).x

    return Row(lambda x: _configured(block.ffn, lean, lambda: run(x)), x_BSD, _params(block), (cos_SF, sin_SF))


def _hf_block(block: Block, ids_BSK: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor,
              x_BSD: torch.Tensor, dtype: torch.dtype) -> Row | None:
    if not hf_baseline.available():
        return None
    hf, forward = hf_baseline.build_decoder_layer(block, ids_BSK.reshape(-1, ids_BSK.shape[-1]), dtype)
    return Row(lambda x: forward(x, cos_SF, sin_SF), x_BSD, _params(hf), (cos_SF, sin_SF))


# name: builder of a non-dropless block-scope variant from dropless's block (same weights); None: not available
BLOCK_VARIANTS: dict[str, Callable[..., Row | None]] = {"hf_transformers": _hf_block}


def build_rows(shape: str, routing: str, dtype: torch.dtype, device: torch.device, tokens: int | None = None,
               seed: int = 0) -> tuple[dict[tuple[str, str], Row], dict, MoELayer]:
    """The rows to measure, the routing metadata, and the MoE layer both scopes share."""
    forwards, meta = build_forwards(shape, routing, dtype, seed, device, only=LAYER_VARIANTS, tokens=tokens)
    T, D, E, K, Fw = dims(shape, tokens)
    x_TD, host_ids_TK = draw_inputs(shape, routing, dtype, seed, device, tokens)
    layer = moe_layer(shape, dtype, seed, device)  # bench layer's weights, shared by both scopes
    rows = {("layer", n): _dropless_layer(layer, host_ids_TK.to(device), x_TD, modes["layer"], lean)
            for n, (modes, lean) in DROPLESS_VARIANTS.items() if "layer" in modes}
    rows.update({("layer", n): Row(*forwards[n]) for n in LAYER_VARIANTS if n in forwards})
    H = max(1, D // HEAD_WIDTH)
    cfg = ModelConfig(d_model=D, n_heads=H, max_seq_len=T, n_dense_layers=0, n_layers=1,
                      moe=MoEConfig(num_experts=E, top_k=K, d_expert=Fw))
    torch.manual_seed(seed)
    model = MoEModel(cfg)  # its one block and the rotary tables it reads (max_seq_len = T positions)
    block = model.blocks[0]
    block.ffn = layer  # the layer scope's layer
    block.to(device=device, dtype=dtype)
    block.ffn.router.float()
    x_BSD = x_TD.detach().view(1, T, D).requires_grad_(True)
    ids_BSK = host_ids_TK.to(device).view(1, T, K)
    cos_SF, sin_SF = model.rope_cos.to(device), model.rope_sin.to(device)
    for name, (modes, lean) in DROPLESS_VARIANTS.items():
        if "block" in modes:
            rows[("block", name)] = _dropless_block(block, ids_BSK, cos_SF, sin_SF, x_BSD, modes["block"], lean)
    for name, build in BLOCK_VARIANTS.items():
        row = build(block, ids_BSK, cos_SF, sin_SF, x_BSD, dtype)
        if row is not None:
            rows[("block", name)] = row
    meta["n_heads"] = H
    return rows, meta, layer


def measure_saved(row: Row) -> SavedBytes:
    row.x.grad = None
    count = saved_bytes(row.fn, row.x, exclude=[*row.params, *row.constants], count_held=True)
    return dataclasses.replace(count, out=None)  # drop the graph now


def measure_peak(row: Row, fwd_bwd: Callable[[], object], device: torch.device
                 ) -> tuple[int | None, int | None]:
    """(peak, peak - allocated at the start) over one fwd+bwd, from the CUDA allocator; None elsewhere.
    One untimed call first, so that one-off allocations (library workspaces) fall outside it; the
    gradients are dropped before the start is read, so the start is weights, input and constants."""
    if device.type != "cuda":
        return None, None
    fwd_bwd()
    for t in (row.x, *row.params):
        t.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    fwd_bwd()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return peak, peak - start


def run(shape: str, routing: str, dtype: torch.dtype, device: torch.device, repeats: int, warmup: int,
        tokens: int | None = None, breakdown: bool = False) -> tuple[list[dict], dict]:
    """One row per variant and scope (and the floor row); with `breakdown`, each row also lists its
    saved storages as [shape, dtype, bytes per token] in the order autograd saved them."""
    rows, meta, layer = build_rows(shape, routing, dtype, device, tokens)
    T = dims(shape, tokens)[0]
    floor = layer_floor_bytes_per_token(layer, torch.empty((), dtype=dtype).element_size())
    fns = {key: _fwd_bwd(r.fn, r.x, r.params) for key, r in rows.items()}
    out = []
    for key, r in tqdm(rows.items(), desc="saved bytes, peak", file=sys.stderr):
        saved = measure_saved(r)
        peak, over = measure_peak(r, fns[key], device)
        out.append({"scope": key[0], "variant": key[1], "saved_bytes_per_token": saved.bytes / T,
                    "saved_over_floor": saved.bytes / T / floor, "peak_bytes": peak,
                    "peak_over_start_bytes": over, "floor_bytes_per_token": floor})
        if breakdown:
            out[-1]["saved_storages"] = [[list(shp), str(dt).removeprefix("torch."), n / T]
                                         for shp, dt, n in saved.items]
    bar = tqdm(total=repeats, desc="fwd+bwd timing", file=sys.stderr)
    ms = interleaved({f"{s}/{v}": fn for (s, v), fn in fns.items()}, repeats, warmup, device,
                     progress=lambda rep: bar.update(1))
    bar.close()
    for r in out:
        r["fwd_bwd_ms"] = ms[f"{r['scope']}/{r['variant']}"]
    out.append({"scope": "layer", "variant": "floor", "saved_bytes_per_token": float(floor),
                "saved_over_floor": 1.0, "peak_bytes": None, "peak_over_start_bytes": None,
                "fwd_bwd_ms": None, "floor_bytes_per_token": floor})
    for scope in ("layer", "block"):
        by = {r["variant"]: r for r in out if r["scope"] == scope}
        if "hf_transformers" in by:
            meta[f"{scope}_dropless_over_hf"] = (by["dropless"]["saved_bytes_per_token"]
                                                 / by["hf_transformers"]["saved_bytes_per_token"])
        # step-time cost of each recompute, ratios of one run: moe_act = the lean default against
        # the keep-everything experts; the others against the default
        base = by["dropless"]["fwd_bwd_ms"]
        meta[f"{scope}_moe_act_time_ratio"] = base / by["dropless_keep_act"]["fwd_bwd_ms"]
        for name in by:
            if name.startswith("dropless_recompute_"):
                meta[f"{scope}_{name.removeprefix('dropless_')}_time_ratio"] = by[name]["fwd_bwd_ms"] / base
    return [{**r, **meta} for r in out], meta


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dropless bench memory", description=__doc__.split("\n")[0])
    add_shape_args(ap)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--tokens", type=int, help="T instead of the shape's")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also list every saved storage of every row (shape, dtype, bytes per token)")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args(argv)
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available to this torch")
        if args.repeats < 1 or args.warmup < 0:
            raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats}, {args.warmup}")
        dims(args.shape, args.tokens)
        if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
            raise ValueError(f"--json {args.json}: its folder does not exist")
    except ValueError as err:
        print(f"dropless bench memory: error: {err}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        rows, meta = run(args.shape, args.routing, DTYPES[args.dtype], device, args.repeats, args.warmup,
                         args.tokens, args.breakdown)
    except ValueError as err:  # e.g. balanced routing that --tokens makes impossible
        print(f"dropless bench memory: error: {err}", file=sys.stderr)
        return 2
    T, D, E, K, Fw = dims(args.shape, args.tokens)
    where = (f"device={torch.cuda.get_device_name(device)}" if device.type == "cuda"
             else f"cpu, threads={torch.get_num_threads()} (peak: the CPU allocator reports none)")
    print(f"memory bench: {args.shape} (T={T} d={D} E={E} k={K} f={Fw}, block: {meta['n_heads']} heads), "
          f"routing={args.routing}, dtype={args.dtype}, {where}, time: median of {args.repeats}")
    print(f"floor (MoE layer): elem*d + elem*k*2f = {rows[-1]['floor_bytes_per_token']} B/token")
    print(format_table(rows, COLUMNS))
    for r in rows if args.breakdown else ():
        if "saved_storages" in r:
            print(f"{r['scope']}/{r['variant']}: saved storages (shape, dtype, B/token)")
            print("\n".join(f"  {str(tuple(shp)):24} {dt:9} {n:10.1f}" for shp, dt, n in r["saved_storages"]))
    for scope in ("layer", "block"):
        if f"{scope}_dropless_over_hf" in meta:
            print(f"{scope}: dropless / hf_transformers saved bytes = {meta[f'{scope}_dropless_over_hf']:.3f}")
        times = ", ".join(f"{k.removeprefix(scope + '_').removesuffix('_time_ratio')} {v:.3f}"
                          for k, v in meta.items() if k.startswith(scope) and k.endswith("_time_ratio"))
        print(f"{scope}: fwd+bwd time ratios (moe_act: dropless / dropless_keep_act; "
              f"recompute_X: dropless_recompute_X / dropless): {times}")
    if args.json:
        atomic.write_text(args.json, json.dumps(rows, indent=1))  # a failed run leaves no partial file
    return 0
