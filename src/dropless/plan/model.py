"""The bytes one rank holds in training, by component: the planner's arithmetic.

Legend: W ranks, P = ep_size (EP group), edp = W / P (ranks holding the same experts), E experts,
L = E / P local experts, T tokens per micro-batch per rank, K experts per token, D the width of the
rows the experts take (the model width, or LatentMoE's latent width).

What each component is (the layout is distributed/parallelize.py's: EP, then FSDP2):
- params: fp32 master weights. Every parameter is taken from the model built on the meta device
  (so a new parameter is counted without touching this file), tied weights once. Every width and
  shape here comes from that model too (the all-to-all rows, the vocabulary), never from config
  fields: the module that makes a tensor is the truth about its shape. Dense parameters are
  FSDP-sharded over all W ranks, the routed experts first sliced to L experts by EP, then sharded over
  edp. FSDP2 shards dim 0 in ceil(n / W) rows and pads every rank's storage to that, so the busiest
  rank (rank 0) holds ceil(dim0 / W) * rest of every parameter. W = 1 is the plain one-process trainer.
  Without FSDP2 (`parallel.fsdp = false`, distributed/replicated.py) nothing is sharded over dp or
  edp: every rank holds what W = 1 holds, with the routed experts cut to its L, and no FSDP gather.
  A LoRA run (train.lora) is counted from the same model built with its adapters: the trainable
  parameters (the adapters, the routers when "router" is a target) in fp32, and the frozen base as
  it is held (layers/frozen_base.py): the meta model already holds its frozen matrices in bf16 for
  every base but fp32, and the routed experts of a packed base count `frozen_base.stored_bytes`
  (fp8 1 + 1/32 B per weight, mxfp4 0.5 + 1/32, nvfp4 0.5 + 1/16 and 4 B per expert matrix). The
  fill's transient (the experts in bf16 until `pack_frozen_base` packs them) is not counted.
- grads: fp32, the same shards (FSDP2's reduce-scatter output is padded like the parameters); the
  trainable parameters only.
- optimizer: per trainable parameter shard, AdamW's two moments in fp32 (`adamw`, 8 B per element) or bf16
  (`adamw_bf16`, 4 B), plus one fp32 step counter per parameter tensor. `muon` is counted as 8 B, an
  upper bound: its matrices hold one fp32 momentum (4 B), only its AdamW parameters hold two.
- activations: activations.py (measured on fake tensors), times the micro-batches alive at once: 1
  without pipeline stages (gradient accumulation runs each micro-batch's backward before the next
  forward). With `model.offload` what stays on the device: the offloaded scopes' saved tensors are
  in offload_host.
- Pipeline stages (parallel.pp_size > 1; pipeline.py says what each rank holds): every rank is
  planned on its own, its stages' modules sharded over the stage's world / pp ranks as above, its
  activations the peak of its schedule's micro-batches in flight (each micro-batch of
  train.batch_size / pp_microbatches rows), the loss's gradient on the last stage only, every
  gradient alive (the micro-batches accumulate), and `pp_buffers`: torch's receive buffers. The plan
  is the rank with the highest peak; `plan_ranks` gives them all. A stage of one rank is the plain
  one-process layout (no FSDP, no EP dispatcher: distributed/pipeline.py).
- ep_buffers: the all-to-all buffers of one MoE layer's forward (send and receive of the dispatch,
  its routing weights and counts, and the combine): transient, one layer at a time, so counted once.
  Any run of W > 1 has them, ep_size 1 included (parallelize.py gives every MoE layer an EP
  dispatcher; over a group of one its all-to-alls are copies).
  Buffered mode: fixed, factor x the balanced need (parallel.ragged_buffer_factor, capped at the
  worst case; ep_plan.link_capacity). Exact mode: the balanced need itself (uniform routing; a skewed
  step needs more).
- fsdp_gather: FSDP2's all-gathered (unsharded, in their own dtype: no mixed-precision policy)
  parameters alive at once: the root unit (embedding, final norm, LM head: the root is not resharded between forward and
  backward) plus two of the largest block's units (the running one and the prefetched next). 0 at W=1.
- loss_grad: the backward of the loss, the largest transient of many runs: the fp32 gradient of the
  logits [T, V] and its copy in the logits' dtype; a LoRA run's loss in chunks (ops/head_loss.py): one
  chunk's logits, softmax and its cast.
- offload_host: the host memory (not the device's) that `model.offload` holds between the forward and
  the backward of one micro-batch: what its scopes move (activations.py measures it with the rest).
  Not in the peak. On CUDA the host copies are pinned storages of torch's caching host allocator.
- peak: params + optimizer + activations + ep_buffers + fsdp_gather + loss_grad + the gradients that
  can be alive with all activations: all of them with gradient accumulation (grad_accum > 1: the
  second micro-batch's forward runs over the first one's gradients), else the largest unit's
  gradient (gradients fill in as the activations are freed). An estimate of the simultaneous sum, not
  an allocator trace: the caching allocator's fragmentation and the framework's workspaces come on
  top (no GPU measurement of it has been made in dropless yet).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..config import RunConfig
from ..config import apply_overrides
from ..layers import frozen_base
from ..model import MoEModel
from ..ops.head_loss import CHUNK_TOKENS
from . import pipeline
from .activations import ActivationBytes, activation_bytes
from .ep_buffers import ep_buffer_bytes, ep_rows
from .pipeline import RankModules

COMPONENTS = ("params", "grads", "optimizer", "activations", "ep_buffers", "pp_buffers", "fsdp_gather",
              "loss_grad", "offload_host")
DEVICE_COMPONENTS = COMPONENTS[:-1]  # offload_host is host memory: not in the device peak
EXPERT_PARAMS = ("w_gate_up_EDF", "w_down_EFD")
MOMENT_BYTES = {"adamw": 8, "adamw_bf16": 4, "muon": 8}  # muon: an upper bound (module note)


@dataclass(frozen=True)
class Plan:
    """Bytes per rank (the busiest rank), by component, and what they were computed for."""

    world: int
    ep_size: int
    tokens: int  # per micro-batch per rank
    bf16: bool
    params: int
    grads: int
    optimizer: int
    activations: int
    ep_buffers: int
    fsdp_gather: int
    loss_grad: int
    peak: int
    activation_detail: ActivationBytes
    pipeline: int = 1  # parallel.pp_size
    offload_host: int = 0  # host bytes model.offload holds (not in peak)
    frozen: int = 0  # of params: the frozen base of a LoRA run, as held (module note)
    pp_buffers: int = 0  # torch's pipeline receive buffers (pipeline.py)
    pp_rank: int = 0  # which pipeline rank this plan is (the busiest by peak, from `plan`)
    stages: tuple[int, ...] = ()  # its stages
    blocks: int = 0  # the blocks of its stages
    in_flight: tuple[tuple[int, int], ...] = ()  # (stage, micro-batches alive) at its peak

    def as_dict(self) -> dict:
        d = asdict(self)
        d["activation_detail"] = {**asdict(self.activation_detail), "total": self.activation_detail.total}
        return d


def _shard(numel: int, dim0: int, ranks: int) -> int:
    """Elements of the busiest rank's FSDP2 shard of a tensor (dim 0 split in ceil(dim0/ranks) rows)."""
    if ranks == 1 or dim0 == 0:
        return numel
    return math.ceil(dim0 / ranks) * (numel // dim0)


def _meta_model(cfg: RunConfig) -> MoEModel:
    with torch.device("meta"):
        return MoEModel(cfg.model, lora=cfg.train.lora)


def _bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def shard_elements(cfg: RunConfig, world: int, model: MoEModel | RankModules | None = None) -> dict[str, int]:
    """Trainable parameter elements on the busiest rank: {'dense', 'experts', 'tensors'}; the bytes
    of the frozen ones there ('frozen', a LoRA run's base as held); and the unsharded bytes of the
    FSDP units for the gather ('root', 'block') (module note). `model`: cfg's model on the meta device,
    or a pipeline rank's part of it (`world` then the ranks of its stage)."""
    ep = cfg.parallel.ep_size
    # without FSDP2 (parallel.fsdp=false) nothing is sharded over dp or edp: every rank holds the
    # whole dense model and its EP slice (distributed/replicated.py)
    shard = world if cfg.parallel.fsdp else 1
    edp = shard // ep if cfg.parallel.fsdp else 1
    base = cfg.train.lora.base if cfg.train.lora.enabled else "fp32"
    packed = base in frozen_base.PACKED
    if packed and world > 1:
        raise ValueError(f"train.lora.base={base!r}: a packed base is for one process (--world {world}); "
                         "layers/frozen_base.py")
    model = model or _meta_model(cfg)
    dense = experts = tensors = frozen = 0
    for name, p in model.named_parameters():  # tied weights are listed once
        dim0 = p.shape[0] if p.dim() else 1
        if name.rsplit(".", 1)[-1] in EXPERT_PARAMS:
            local0 = dim0 // ep
            n = _shard(p.numel() // ep, local0, edp if shard > 1 else 1)
            if p.requires_grad:
                experts += n
            elif packed:  # one process: the whole local stack, packed
                frozen += frozen_base.stored_bytes(base, local0, p.shape[1], p.shape[2])
            else:
                frozen += n * p.element_size()
            tensors += p.requires_grad
            continue
        n = _shard(p.numel(), dim0, shard)
        if p.requires_grad:
            dense, tensors = dense + n, tensors + 1
        else:
            frozen += n * p.element_size()
    # a tied head weight is the embedding's parameter: once
    root = sum({id(p): _bytes(p) for m in (model.embed, model.norm, model.head) if m is not None
                for p in m.parameters()}.values())
    # a block's gathered units: its own parameters, with the experts cut to this rank's EP slice
    # (the experts and the router are units of their own, gathered while the block runs)
    def block_unit(b: torch.nn.Module) -> int:
        whole = sum(_bytes(p) for p in b.parameters())
        if not b.is_moe:
            return whole
        return whole - sum(_bytes(getattr(b.ffn.experts, n)) for n in EXPERT_PARAMS) * (ep - 1) // ep

    return {"dense": dense, "experts": experts, "tensors": tensors, "frozen": frozen, "root": root,
            "block": max((block_unit(b) for b in model.blocks), default=0)}


def _check_world(cfg: RunConfig, world: int) -> None:
    p = cfg.parallel
    if world < 1 or world % p.ep_size:
        raise ValueError(f"--world {world}: must be a positive multiple of parallel.ep_size={p.ep_size}")
    if world % (p.ep_size * p.pp_size):
        raise ValueError(f"--world {world}: must be a multiple of parallel.pp_size x parallel.ep_size = "
                         f"{p.pp_size} x {p.ep_size}")


def plan(cfg: RunConfig, world: int) -> Plan:
    """The per-rank bytes of training `cfg` on `world` ranks (module note): the busiest rank's; with
    pipeline stages the rank of the highest peak (`plan_ranks` for every rank)."""
    if cfg.parallel.pp_size > 1:
        return max(plan_ranks(cfg, world), key=lambda p: p.peak)
    _check_world(cfg, world)
    t = cfg.train
    bf16 = t.dtype != "fp32"  # "auto" plans for an accelerator: bf16 (CUDA and AMX CPUs pick it)
    tokens = t.batch_size * t.seq_len
    model = _meta_model(cfg)
    el = shard_elements(cfg, world, model)
    act = activation_bytes(cfg.model, t.batch_size, t.seq_len, bf16, ep_rows(cfg, tokens, world), t.lora)
    V = model.head.weight.shape[0]
    loss_grad = tokens * V * (4 + (2 if bf16 else 0))  # [T, V] logits' gradient
    if t.lora.enabled:  # the loss in chunks (ops/head_loss.py): one chunk's logits, softmax, its cast
        loss_grad = min(t.batch_size * t.seq_len, CHUNK_TOKENS) * V * (8 + (2 if bf16 else 0))
    return _assemble(cfg, world, world, tokens, bf16, el, act.total, act.host_total, ep_buffer_bytes(cfg, tokens, bf16, world, model),
                     0, loss_grad, t.grad_accum > 1, act)


def _assemble(cfg: RunConfig, world: int, stage_world: int, tokens: int, bf16: bool, el: dict[str, int], activations: int,
              offload_host: int, ep_buf: int, pp_buf: int, loss_grad: int, accumulates: bool,
              act: ActivationBytes, **where: object) -> Plan:
    """A Plan from one rank's parts (module note): its parameter shards `el` over `stage_world` ranks
    (the world without pipeline stages), its activations and buffers."""
    t = cfg.train
    shards = el["dense"] + el["experts"]  # trainable elements
    grads = 4 * shards
    params = grads + el["frozen"]
    optimizer = MOMENT_BYTES[t.optimizer] * shards + 4 * el["tensors"]
    fsdp = el["root"] + 2 * el["block"] if stage_world > 1 and cfg.parallel.fsdp else 0
    unit_grad = 4 * shards // max(cfg.model.n_layers, 1)
    live_grads = grads if accumulates else min(grads, unit_grad)
    peak = params + optimizer + activations + ep_buf + pp_buf + fsdp + loss_grad + live_grads
    return Plan(world, cfg.parallel.ep_size, tokens, bf16, params, grads, optimizer, activations, ep_buf, fsdp,
                loss_grad, peak, act, cfg.parallel.pp_size, offload_host, el["frozen"], pp_buf, **where)


def plan_ranks(cfg: RunConfig, world: int) -> list[Plan]:
    """Every pipeline rank's plan (module note; pipeline.py): `world` / pp_size ranks run each
    stage (FSDP2 and EP inside it), each micro-batch is train.batch_size / pp_microbatches rows."""
    _check_world(cfg, world)
    spec, t = cfg.parallel.pipeline, cfg.train
    stage_world = world // spec.pp_size
    bf16 = t.dtype != "fp32"
    rows = t.batch_size // spec.microbatches
    tokens = rows * t.seq_len
    model = _meta_model(cfg)
    act = activation_bytes(cfg.model, rows, t.seq_len, bf16, ep_rows(cfg, tokens, stage_world), t.lora)
    shapes = pipeline.ranks(spec, model, t.seq_len)
    last = spec.num_stages - 1
    device, host = {}, {}  # per stage, one micro-batch
    for shape in shapes:
        for s, blocks in zip(shape.stages, shape.blocks):
            moe = sum(model.blocks[i].is_moe for i in blocks)
            device[s] = moe * act.moe_block + (len(blocks) - moe) * act.dense_block + (act.head if s == last else 0)
            if s != last:  # its output, which torch's stage keeps until the micro-batch's backward
                device[s] += rows * t.seq_len * model.cfg.d_model * 4
            host[s] = moe * act.moe_host + (len(blocks) - moe) * act.dense_host
    V, D = model.head.weight.shape[0], model.cfg.d_model
    accumulates = spec.microbatches * t.grad_accum > 1
    ints = pipeline.carried_ints(model, bool(cfg.data.document_mask))
    plans = []
    for shape in shapes:
        part = RankModules(model, shape)
        el = shard_elements(cfg, stage_world, part)
        peak_act, alive = pipeline.in_flight(spec, shape.pp_rank, {s: device[s] for s in shape.stages})
        offload = sum(alive[s] * host[s] for s in shape.stages)
        ep_buf = ep_buffer_bytes(cfg, tokens, bf16, stage_world, model) if part.moe_layers() else 0
        pp_buf = pipeline.recv_buffer_bytes(spec, shape, rows, t.seq_len, D, ints)
        loss_grad = tokens * V * (4 + (2 if bf16 else 0)) if shape.last else 0
        plans.append(_assemble(cfg, world, stage_world, tokens, bf16, el, peak_act, offload, ep_buf, pp_buf, loss_grad,
                               accumulates, act, pp_rank=shape.pp_rank, stages=shape.stages,
                               blocks=sum(map(len, shape.blocks)), in_flight=tuple(sorted(alive.items()))))
    return plans


def with_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """A validated copy of cfg with dotted `a.b=value` overrides (a ValueError names the field)."""
    return apply_overrides(cfg, overrides)
