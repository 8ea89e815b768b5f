"""`python -m dropless.plan.validate`: the planner's prediction beside bytes measured from real
tensors, on the CPU, at world 1, 2 and 4 (FSDP2 + EP over gloo, spawned processes).

    python -m dropless.plan.validate [--variants grid,offload,recompute_ep] [--cases tiny,small,medium]
                                     [--worlds 1,2,4] [--steps 2] [--dtype bf16|fp32]
                                     [--set a.b=value ...] [--no-ep] [--json FILE]

A benchmark, not a test (minutes of CPU). Each case builds the model and optimizer exactly as the
trainer does (built on meta, EP then FSDP2 there, each rank's shards filled: distributed/materialize.py; train/optim.py)
and runs `--steps` training steps on random tokens; on every rank it measures, from live tensors and
counted otherwise than the planner counts them:
- params: the storages of the local parameter shards (DTensor local tensors: FSDP2's padded shards);
- grads: the storages of the local gradient shards after the backward;
- optimizer: the storages of the optimizer's state tensors after a step;
- activations: every storage the forward created that is still alive after it (a dispatch mode sees
  each op's outputs; weak references tell which survived), less parameter and buffer storages
  (FSDP2's root keeps its gathered parameters through the forward): what the graph and the model's
  output keep for the backward. Not the planner's meta count: no saved-tensor hooks, real kernels.
  With `model.offload` the host copies (on the CPU, storages like the others) are left out: they
  are the next component, and the activations are what stays on the device;
- offload_host: the bytes `model.offloader.counter` says the forward moved to host (0 without
  offload);
- ep_buffers: the storages every all-to-all of one MoE layer's forward allocates and sends
  (distributed/comm.py `_exchange`: its input and its output), averaged over the layers.
The busiest rank's figure (max over ranks) is compared with the planner's (`plan.model.plan`) for
the same config; the ratio predicted / measured must lie in [0.9, 1.1] for every component.

Cases: `tiny` is the preset (4 blocks, d=256, 16 experts top-2, 16 x 256 tokens); `small` and
`medium` are the `bench layer` shapes (T=4096 as 16 x 256, d=512/1024, 64 experts top-8, f=256/512,
d/64 heads) as a 2-block model (one dense block, one MoE block). `qwen3_30b_a3b_1l` is the recipe
`plan/qwen3_30b_a3b` at its widths (d 2048, 32 query / 4 key-value heads of 128, q/k norm, top-8
experts of width 768, bf16 autocast, AdamW) as 1 x 512 tokens, cut to what 4 ranks fit in 10 GiB of
a CPU host (AdamW holds 16 B per parameter): 1 MoE block, 64 experts (EP 4 keeps 16 per rank, as the
full model at EP 8) and a vocabulary of 16384 (151936 would hold 10 GB in embedding and head alone).
Routing is the model's own token-choice router at initialisation (not `forced_balance`, whose K consecutive experts per token
land on one or two EP ranks, far fewer than independent choices: the de-dup traffic would say more
about that generator than about training). World 2 runs EP 2 in buffered mode; world 4 runs EP 2 x 2 expert-data-parallel
in exact mode (FSDP shards each expert slice over 2 ranks).
`--no-ep` keeps ep_size 1 at every world (FSDP only; every MoE layer still gets an EP dispatcher
over a group of one); `--set` adds overrides to every case (e.g. a recompute mode). `--cases`,
`--worlds`, `--set` and `--no-ep` shape the `grid` variant only.

Variants (`--variants`, default all four):
- `grid`: every case at every world, as above;
- `offload`: fixed runs with `model.offload` (OFFLOAD_RUNS): the activations are what stays on the
  device, `offload_host` the bytes moved (the offloader's counter against the planner's);
- `recompute_ep`: fixed runs with recompute under expert parallelism (RECOMPUTE_EP_RUNS: world 2 EP 2
  buffered and world 4 EP 2 exact, recompute `layer` and `moe`): a recomputed MoE layer keeps no
  dispatched rows (it repeats its all-to-alls in the backward);
- `pipeline`: pipeline stages (validate_pipeline.py PIPELINE_RUNS: pp 2 at world 2, pp 2 x ep 2 and
  pp 2 x edp 2 at world 4, and each schedule at world 2), every pipeline rank against its own plan,
  with the schedule's micro-batches in flight and torch's receive buffers (`pp_buffers`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import atomic
from ..config import RunConfig, load_config
from ..saved_bytes import AliveStorages
from .gloo_ranks import on_ranks
from .model import plan
from .validate_pipeline import PIPELINE_RUNS, pipeline_rows

BENCH_SHAPE = ["model.n_layers=2", "model.n_dense_layers=1", "model.d_ff_dense=1024"]
# name: (the preset it starts from, its overrides)
CASES = {
    "tiny": ("tiny", []),
    "small": ("tiny", ["model.d_model=512", "model.n_heads=8", "model.moe.num_experts=64", "model.moe.top_k=8",
                       "model.moe.d_expert=256", *BENCH_SHAPE]),
    "medium": ("tiny", ["model.d_model=1024", "model.n_heads=16", "model.moe.num_experts=64", "model.moe.top_k=8",
                        "model.moe.d_expert=512", *BENCH_SHAPE]),
    # the recipe's widths (d 2048, 32 q / 4 kv heads of 128, q/k norm, top-8 of width 768); what 4
    # ranks of a 24 GiB CPU host hold cut (module note): 1 block, 64 experts, vocabulary 16384
    "qwen3_30b_a3b_1l": ("plan/qwen3_30b_a3b", ["model.n_layers=1", "model.moe.num_experts=64",
                                                "model.vocab_size=16384", "train.seq_len=512",
                                                "model.max_seq_len=512"]),
}
WORLD_LAYOUT = {1: [], 2: ["parallel.ep_size=2", "parallel.ep_mode=buffered"],
                4: ["parallel.ep_size=2", "parallel.ep_mode=exact"]}
MEASURED = ("params", "grads", "optimizer", "activations", "ep_buffers", "offload_host")
# (case, world, overrides on top of the case's layout at that world)
OFFLOAD_RUNS = [
    ("tiny", 1, ('model.offload=["layer"]',)),
    ("tiny", 1, ('model.offload=["attn","norm","moe"]',)),
    ("tiny", 1, ('model.offload=["experts"]',)),
    ("tiny", 1, ('model.offload=["attn","norm"]', 'model.recompute=["moe"]')),
    ("small", 1, ('model.offload=["moe"]',)),
    ("tiny", 2, ('model.offload=["moe"]',)),  # EP 2 buffered: the received rows go to host
]
RECOMPUTE_EP_RUNS = [
    ("tiny", 2, ('model.recompute=["layer"]',)),
    ("tiny", 2, ('model.recompute=["moe"]',)),
    ("small", 2, ('model.recompute=["moe"]',)),
    ("tiny", 4, ('model.recompute=["moe"]',)),
]
PIPELINED = "pipeline"  # a run's marker in place of its EP flag
VARIANTS = ("grid", "offload", "recompute_ep", "pipeline")


def case_config(case: str, world: int, dtype: str, extra: tuple[str, ...] = (), ep: bool = True) -> RunConfig:
    from ..runs.presets import preset_path
    preset, shape = CASES[case]
    over = list(shape) + (WORLD_LAYOUT[world] if ep else [])
    # AdamW: the planner's optimizer bytes are exact for it (Muon's are a stated upper bound)
    over += [f"train.dtype={dtype}", "train.device=cpu", "train.optimizer=adamw", *extra]
    return load_config(preset_path(preset), over)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure(cfg: RunConfig, steps: int, distributed: bool) -> dict[str, int]:
    """One rank's measured bytes (module note); the trainer's build and step, on random tokens."""
    from ..distributed import comm
    from ..distributed import parallelize as par
    from ..distributed import replicated
    from ..distributed.materialize import build_model
    from ..distributed.mesh import build_meshes
    from ..layers import offload
    from ..train.optim import build_optimizer

    t = cfg.train
    torch.manual_seed(t.seed)
    p = cfg.parallel.with_token_bound(t.batch_size * t.seq_len)
    meshes = build_meshes(p.ep_size, "cpu", p.hier_node_size) if distributed else None
    model, names, _ = build_model(cfg.model, torch.device("cpu"), t.seed, meshes, p)
    opt = build_optimizer(model, t)
    out: dict[str, int] = {"params": _storage_bytes(list(model.parameters()))}
    sent: list[int] = []
    real_exchange = comm._exchange
    recording = {"on": False}

    def exchange(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = real_exchange(x, *args, **kwargs)
        if recording["on"]:
            sent.append(x.numel() * x.element_size() + y.untyped_storage().nbytes())
        return y

    comm._exchange = exchange
    host_copies: set[int] = set()  # the offload's host storages: not device activations
    real_copy = offload._HostCopy

    class HostCopy(real_copy):  # type: ignore[misc, valid-type]
        def __init__(self, t: torch.Tensor, stream: Any) -> None:
            super().__init__(t, stream)
            host_copies.add(self.host.data_ptr())

    offload._HostCopy = HostCopy
    gen = torch.Generator().manual_seed(t.seed + (dist.get_rank() if distributed else 0))
    try:
        for _ in range(steps):
            tok = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=gen)
            x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
            sent.clear()
            recording["on"] = True
            with AliveStorages() as alive, torch.autocast("cpu", torch.bfloat16, enabled=t.dtype == "bf16"):
                res = model(x, y)
            recording["on"] = False
            constants = {_local(q).untyped_storage().data_ptr()
                         for q in [*model.parameters(), *model.buffers()]}
            out["activations"] = alive.settled_bytes(constants | host_copies)
            host_copies.clear()
            out["offload_host"] = model.offloader.counter.take().bytes_to_host if model.offloader else 0
            del alive
            n_moe = cfg.model.n_moe_layers
            out["ep_buffers"] = sum(sent) // n_moe if sent and n_moe else 0
            res.loss.backward()
            del res
            if distributed and not cfg.parallel.fsdp:
                replicated.finish_grads_(model, names, meshes, t.grad_clip)
            elif distributed:
                par.finish_grads_(model, names, meshes.mesh.size(1), t.grad_clip, meshes.dp_group)
            out["grads"] = _storage_bytes([q.grad for q in model.parameters() if q.grad is not None])
            opt.step()
            opt.zero_grad(set_to_none=True)
            out["optimizer"] = _storage_bytes([v for s in opt.state.values() for v in s.values()
                                               if isinstance(v, torch.Tensor)])
    finally:
        comm._exchange = real_exchange
        offload._HostCopy = real_copy
    return out


def measured_max(cfg: RunConfig, world: int, steps: int) -> dict[str, int]:
    """The busiest rank's figure of each component (max over ranks); world > 1 spawns gloo ranks."""
    if world == 1:
        torch.set_num_threads(1)
        return measure(cfg, steps, distributed=False)
    ranks = on_ranks(world, measure, cfg, steps, True)
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


def rows_for(case: str, world: int, dtype: str, steps: int, extra: tuple[str, ...] = (),
             ep: bool = True) -> list[dict[str, Any]]:
    cfg = case_config(case, world, dtype, extra, ep)
    pred = plan(cfg, world).as_dict()
    meas = measured_max(cfg, world, steps)
    rows = []
    for comp in MEASURED:
        m, p = meas[comp], pred[comp]
        ratio = p / m if m else (1.0 if p == 0 else float("inf"))
        rows.append({"case": case, "world": world, "set": " ".join(extra), "ep_size": cfg.parallel.ep_size,
                     "ep_mode": cfg.parallel.ep_mode, "dtype": dtype, "component": comp,
                     "predicted": p, "measured": m, "ratio": ratio, "ok": 0.9 <= ratio <= 1.1})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dropless.plan.validate", description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"{', '.join(VARIANTS)} (module note)")
    ap.add_argument("--cases", default="tiny,small,medium")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value",
                    help="extra config overrides for every case (e.g. model.recompute=[\"layer\"])")
    ap.add_argument("--no-ep", action="store_true", help="FSDP only at every world (no expert parallelism)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        variants = args.variants.split(",")
        for v in variants:
            if v not in VARIANTS:
                raise ValueError(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
        cases = args.cases.split(",")
        worlds = [int(w) for w in args.worlds.split(",")]
        for c in cases:
            if c not in CASES:
                raise ValueError(f"--cases: {c!r} is not one of {', '.join(CASES)}")
        for w in worlds:
            if w not in WORLD_LAYOUT:
                raise ValueError(f"--worlds: {w} is not one of {', '.join(map(str, WORLD_LAYOUT))}")
        if args.steps < 1:
            raise ValueError(f"--steps {args.steps}: must be >= 1")
        runs: list[tuple[str, int, tuple[str, ...], bool | str]] = []
        if "grid" in variants:
            runs += [(c, w, tuple(args.overrides), not args.no_ep) for c in cases for w in worlds]
        if "offload" in variants:
            runs += [(c, w, over, True) for c, w, over in OFFLOAD_RUNS]
        if "recompute_ep" in variants:
            runs += [(c, w, over, True) for c, w, over in RECOMPUTE_EP_RUNS]
        if "pipeline" in variants:
            runs += [(c, w, over, PIPELINED) for c, w, over in PIPELINE_RUNS]
        for c, w, over, ep in runs:
            case_config(c, w, args.dtype, over, ep is True)  # refuse early
    except ValueError as e:
        print(f"dropless plan validate: error: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm
    rows: list[dict[str, Any]] = []
    for case, world, over, ep in tqdm(runs, desc="plan validate", file=sys.stderr):
        if ep is PIPELINED:
            cfg = case_config(case, world, args.dtype, over, ep=False)
            rows += pipeline_rows(cfg, case, world, args.dtype, args.steps, over)
        else:
            rows += rows_for(case, world, args.dtype, args.steps, over, ep)
    print(f"{'case':<7} {'world':>5} {'ep':>3} {'mode':<8} {'component':<12} {'predicted B':>14} "
          f"{'measured B':>14} {'ratio':>7}  set")
    for r in rows:
        print(f"{r['case']:<7} {r['world']:>5} {r['ep_size']:>3} {r['ep_mode']:<8} {r['component']:<12} "
              f"{r['predicted']:>14,} {r['measured']:>14,} {r['ratio']:>7.4f}  {r['set']}"
              f"{'' if r['ok'] else '  OUTSIDE 10%'}")
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} components within 10%")
    if args.json:
        atomic.write_text(args.json, json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
