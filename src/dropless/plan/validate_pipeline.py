"""The planner's pipeline-stage prediction beside bytes measured from real tensors (validate.py's
`pipeline` variant): each pipeline rank's plan (`plan.model.plan_ranks`) against that rank, over gloo.

Each run builds this rank's stages exactly as the trainer does (train/layout.py: the whole model on
meta, `distributed.pipeline.Pipeline` over the (pp, edp, ep) mesh, `PipelineModel`, the trainer's
optimizer) and runs `--steps` optimizer steps of `Pipeline.step` on random tokens. On every rank it
measures, counted otherwise than the planner counts them:
- params, grads, optimizer: the storages of the local shards, gradients (after the step's backward)
  and optimizer state (after a step), as validate.py;
- activations: the most bytes alive at once, over the step, of the storages made inside a stage's
  forward or the loss (a dispatch mode records them; a flag limits it to those windows), read after
  every forward and every loss with the parameters' and buffers' storages left out: the schedule's
  micro-batches in flight, as they really overlap, whatever the planner assumed;
- pp_buffers: the storages of the receive buffers torch's stages hold (`args_recv_info`,
  `grad_recv_info`), once each;
- ep_buffers: as validate.py, the all-to-alls of one MoE layer's forward (one micro-batch).
A pipeline rank's figure is the max over its stage's ranks; each is compared with that rank's plan.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..config import RunConfig
from ..saved_bytes import AliveStorages
from .gloo_ranks import on_ranks
from .model import plan_ranks

MEASURED = ("params", "grads", "optimizer", "activations", "ep_buffers", "pp_buffers")
# (case, world, overrides): pp 2 at world 2 and 4 (x ep 2), each schedule at world 2
PIPELINE_RUNS = [
    ("tiny", 2, ("parallel.pp_size=2",)),
    # 4096 tokens per micro-batch, as the grid's EP runs: fewer make the init router's uneven split
    # (the busiest rank's received rows) a larger share of the exact mode's balanced buffers
    ("tiny", 4, ("parallel.pp_size=2", "parallel.ep_size=2", "parallel.ep_mode=exact", "train.batch_size=32")),
    ("tiny", 4, ("parallel.pp_size=2",)),  # pp 2 x edp 2: FSDP2 inside each stage
    ("tiny", 2, ("parallel.pp_size=2", "parallel.pp_schedule=gpipe")),
    ("tiny", 2, ("parallel.pp_size=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2",
                 "parallel.pp_microbatches=4", "train.batch_size=16")),
    ("tiny", 2, ("parallel.pp_size=2", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2",
                 "parallel.pp_microbatches=4", "train.batch_size=16")),
    # the token ids and targets passed stage to stage, the MTP module and an embedding copy on the last
    ("tiny", 2, ("parallel.pp_size=2", "model.mtp_depth=1", "model.moe.router.strategy=hash")),
]


class _Windows(AliveStorages):
    """AliveStorages that records only while `on` (a stage's forward, the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if self.on:
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}


def measure_pipeline(cfg: RunConfig, steps: int) -> dict[str, int]:
    """This rank's measured bytes (module note) and its pipeline rank."""
    from ..distributed import comm
    from ..distributed.mesh import build_pipeline_meshes
    from ..distributed.pipeline import Pipeline
    from ..distributed.pipeline_model import PipelineModel
    from ..model import MoEModel
    from ..train.optim import build_optimizer

    t = cfg.train
    p = cfg.parallel.with_token_bound(t.batch_size * t.seq_len)
    torch.manual_seed(t.seed)
    dtype = torch.bfloat16 if t.dtype == "bf16" else None
    meshes = build_pipeline_meshes(p.pp_size, p.ep_size, "cpu")
    with torch.device("meta"):
        whole = MoEModel(cfg.model)
    pipe = Pipeline(whole, p.pipeline, meshes, p, torch.device("cpu"), t.batch_size, t.seq_len, t.seed,
                    logits_dtype=dtype or torch.float32)
    model = PipelineModel(pipe, whole.num_params())
    opt = build_optimizer(model, t, dtype)
    out: dict[str, int] = {"pp_rank": pipe.pp_rank, "params": sum(_storages(list(model.parameters())).values())}
    alive = _Windows()
    peak = {"activations": 0}

    def constants() -> set[int]:
        return set(_storages([*model.parameters(), *model.buffers()]))

    def read() -> None:
        alive.on = False
        peak["activations"] = max(peak["activations"], alive.settled_bytes(constants()))

    def start(*_: Any) -> None:
        alive.on = True

    for m in pipe.modules:
        m.register_forward_pre_hook(start)
        m.register_forward_hook(lambda *_: read())
    loss_fn = pipe.schedule._loss_fn

    def loss(*args: Any) -> torch.Tensor:
        alive.on = True
        value = loss_fn(*args)
        read()
        return value

    pipe.schedule._loss_fn = loss
    sent: list[int] = []
    real_exchange = comm._exchange

    def exchange(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = real_exchange(x, *args, **kwargs)
        if alive.on:
            sent.append(x.numel() * x.element_size() + y.untyped_storage().nbytes())
        return y

    comm._exchange = exchange
    # the ranks of one pipeline read the same tokens (the first stage) and targets (the last)
    gen = torch.Generator().manual_seed(t.seed + dist.get_rank() % (dist.get_world_size() // p.pp_size))
    try:
        for _ in range(steps):
            tok = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=gen)
            sent.clear()
            with alive, torch.autocast("cpu", torch.bfloat16, enabled=dtype is not None):
                pipe.step([(tok[:, :-1].contiguous(), tok[:, 1:].contiguous())])
            out["activations"] = peak["activations"]
            layers = len(model.moe_layers()) * pipe.spec.microbatches
            out["ep_buffers"] = sum(sent) // layers if sent and layers else 0
            stages = pipe.schedule._stages if hasattr(pipe.schedule, "_stages") else [pipe.schedule._stage]
            bufs = [i.buffer for s in stages for infos in (*s.args_recv_info.values(), *s.grad_recv_info.values())
                    for i in infos if getattr(i, "buffer", None) is not None]
            out["pp_buffers"] = sum(_storages(bufs).values())
            pipe.clip_grad_norm_(t.grad_clip)
            out["grads"] = sum(_storages([q.grad for q in model.parameters() if q.grad is not None]).values())
            opt.step()
            opt.zero_grad(set_to_none=True)
            out["optimizer"] = sum(_storages([v for s in opt.state.values() for v in s.values()
                                              if isinstance(v, torch.Tensor)]).values())
    finally:
        comm._exchange = real_exchange
    return out


def measured_by_pp_rank(cfg: RunConfig, world: int, steps: int) -> dict[int, dict[str, int]]:
    """Each pipeline rank's figures: the max over the ranks of its stage."""
    ranks = on_ranks(world, measure_pipeline, cfg, steps)
    out: dict[int, dict[str, int]] = {}
    for r in ranks:
        mine = out.setdefault(r["pp_rank"], {k: 0 for k in MEASURED})
        for k in MEASURED:
            mine[k] = max(mine[k], r[k])
    return out


def pipeline_rows(cfg: RunConfig, case: str, world: int, dtype: str, steps: int,
                  extra: tuple[str, ...]) -> list[dict[str, Any]]:
    """validate.py's rows for one run (`cfg`: the case's config with `extra`)."""
    predicted = {p.pp_rank: p.as_dict() for p in plan_ranks(cfg, world)}
    measured = measured_by_pp_rank(cfg, world, steps)
    rows = []
    for r, meas in sorted(measured.items()):
        for comp in MEASURED:
            m, p = meas[comp], predicted[r][comp]
            ratio = p / m if m else (1.0 if p == 0 else float("inf"))
            rows.append({"case": case, "world": world, "set": " ".join(extra) + f" (pp rank {r})",
                         "ep_size": cfg.parallel.ep_size, "ep_mode": cfg.parallel.ep_mode, "dtype": dtype,
                         "component": comp, "predicted": p, "measured": m, "ratio": ratio,
                         "ok": 0.9 <= ratio <= 1.1})
    return rows
