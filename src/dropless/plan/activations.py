"""Activation bytes per micro-batch, measured on fake tensors: what each block of the configured
shape keeps for its backward, under each recompute mode, without allocating it.

Legend: B sequences per micro-batch, S sequence length, T = B*S tokens, D model width, K experts
per token, E experts (L on this rank under expert parallelism), R rows of the expert GEMMs.

Why a measurement, not a formula: what a layer saves changes whenever someone changes the layer
(the lean MoE default removes whole [T*K, D] tensors); a hand formula would go stale silently. So
the model is built from the config and one block of each kind (dense, MoE) runs forward, all on
*fake tensors* (`torch._subclasses.FakeTensorMode`: meta storage, no allocation, but the tensors
claim to be on the CPU, so CPU autocast casts them as in training and SDPA takes the CPU flash
kernel, which keeps the output and log-sum-exp as the GPU flash kernels do; on plain `meta` SDPA
falls back to the math path and would count an [S, S] matrix per head that no training run keeps).
Every width comes from that model, never from config fields: its blocks, norm, head and MTP
modules are the ones measured, a block's input is the embedding's output ([B, S, D] in its dtype)
and its rotary tables are the model's own buffers (so an explicit head width or MLA's rotary part
needs nothing here). The count is `dropless.saved_bytes.saved_bytes` (storages, once each,
parameters excluded), plus two things that are alive during the backward but that autograd does
not "save":
- the inputs a recompute checkpoint keeps by reference (docs/recompute.md: inside a checkpointed region
  the checkpoint's own hooks shadow the counter, and the region's inputs, often closure-captured, are
  no saved tensors): every storage an op inside the region reads that the region did not create
  (`_RegionReads`), parameters and constant tables excluded;
- what the model returns and the trainer holds until the backward: each MoE layer's `MoEOutput`
  (its output y, ids, losses, statistics: `ModelOutput.moe`), the logits.
The block's input counts when the block keeps it (its first norm saves it, a checkpoint reads it),
not otherwise: under `layer` or `norm` offload nothing on the device keeps it once the block has run.

The embedding, final norm, LM head and loss form the `head` part, measured the same way (the last
block's output counts where an op saves it; the logits and the fp32 log-softmax of the loss are there). Token
ids and targets are batch inputs, made before the forward: not counted (16 bytes per token).

Activation offload (`model.offload`, layers/offload.py) runs as in training: the block is built
with its offload scopes, whose saved-tensor hooks are inner to the counter's and take what is saved
inside them (so the counter sees only what stays on the device), and the block's offload counter adds
up what they move (`bytes_to_host`: the host bytes of the micro-batch). On fake tensors the host copy
is a stand-in that records the storage's size and allocates nothing (fake_world.py, with the other
stand-ins: the fp32 grouped GEMM, the expert GEMMs that read their group ends on the host (the
`loop` backend, the low-precision recipes: run with ends of the planner's own), and attention with
value heads narrower than the query heads, which MLA has).

Expert parallelism changes only the expert GEMMs' row count (R: the received rows, which in the
buffered mode are the fixed buffer of factor x the balanced need), so the MoE block is measured on one
device and its experts' share is replaced: minus the experts on the local rows (T*K, each group
padded to the dispatcher's alignment: a low-precision recipe's token block) as the one-device
dispatcher runs them (with a row source: the lean experts keep a reference to the token rows, no
rows), plus the L local experts on R rows as the EP dispatcher runs them (no row source: the lean
experts keep the R received rows, D wide, in the compute dtype), both measured on fake tensors the
same way. The substitution goes where the
experts' saved tensors go: nowhere when the experts are recomputed (`moe`, `layer`: the recompute
repeats the all-to-alls and keeps no dispatched rows, docs/recompute.md), into the host bytes when they
are offloaded (`layer`, `moe`, `experts`), else into the device bytes.

A LoRA run (train.lora) is measured on the model built with its adapters and its base as held
(layers/frozen_base.py): what the adapters keep (each LoRALinear its [T, r] product; the routed
experts h plus two [R, r] products, ops/lora_experts.py) is in the count, and a frozen weight held in
bf16 is read by autocast without a copy (a frozen fp32 weight still has its bf16 copy kept). A
packed base is measured as its bf16 stand-in: the lean Functions keep neither (they dequantise
again in the backward); the plain composition (capacity layout, `lean = False`) would keep a packed
base's dequantised stacks, which the stand-in, read without a copy under bf16 autocast, does not.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..config import LoRAConfig, ModelConfig
from ..layers import frozen_base, lora as lora_layers
from ..layers import recompute as recompute_mod
from ..layers.experts import ExpertBatch, GroupedExperts
from ..layers.mtp import mtp_loss
from ..model import Block, MoEModel
from ..ops.head_loss import head_loss
from ..ops.lean_experts import RowSource
from ..saved_bytes import saved_bytes
from .fake_world import fake_world, storage_key


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes kept for the backward of one micro-batch on one rank (per block kind and in total)."""

    tokens: int  # T of the micro-batch
    head: int  # embedding output aside: final norm, LM head, logits, loss (+ the MTP modules)
    dense_block: int  # one dense block (0 when there is none), on the device
    moe_block: int  # one MoE block, expert rows as this rank's GEMMs see them, on the device
    n_dense: int
    n_moe: int
    dense_host: int = 0  # what model.offload moves to host memory, per dense block
    moe_host: int = 0  # per MoE block
    # measured block by block (a LoRA run: module note): (device, host) of every block, in order;
    # then dense_block and moe_block are the largest of their kind
    per_block: tuple[tuple[int, int], ...] = ()

    @property
    def host_total(self) -> int:
        if self.per_block:
            return sum(h for _, h in self.per_block)
        return self.n_dense * self.dense_host + self.n_moe * self.moe_host

    @property
    def total(self) -> int:
        if self.per_block:
            return self.head + sum(d for d, _ in self.per_block)
        return self.head + self.n_dense * self.dense_block + self.n_moe * self.moe_block

    @property
    def per_token(self) -> float:
        return self.total / self.tokens


class _RegionReads(TorchDispatchMode):
    """Storages that ops read but that were not created inside the mode: a region's inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.created: set[int] = set()
        self.read: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and storage_key(t) not in self.created:
                self.read.setdefault(storage_key(t), t)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.created.add(storage_key(t))
        return out


def _current_pack() -> Callable[[torch.Tensor], Any]:
    """The pack hook on top of the saved-tensor hook stack: inside `saved_bytes`, its counter."""
    pack, _ = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return pack


@contextlib.contextmanager
def _checkpoints_count_inputs() -> Iterator[None]:
    """While inside: every recompute checkpoint (layers/recompute.py) passes its region's inputs to
    the counter's pack hook on the forward (the recompute in the backward is not counted)."""
    real = recompute_mod.checkpoint

    def counting(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        pack = _current_pack()
        done: list[bool] = []

        def region(*a: Any) -> Any:
            if done:
                return fn(*a)
            done.append(True)
            with _RegionReads() as reads:
                out = fn(*a)
            for t in reads.read.values():
                pack(t)
            return out

        return real(region, *args, **kwargs)

    recompute_mod.checkpoint = counting
    try:
        yield
    finally:
        recompute_mod.checkpoint = real


def _autocast(bf16: bool) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", torch.bfloat16, enabled=bf16)


def _held_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of a block's MoEOutput, which ModelOutput.moe holds through the backward."""
    moe = getattr(out, "moe", None)
    if moe is None:
        return []
    return [t for f in fields(moe) for t in tree_flatten(getattr(moe, f.name))[0] if isinstance(t, torch.Tensor)]


def _stream(model: MoEModel, batch: int, seq_len: int, grad: bool = True) -> torch.Tensor:
    """A block's input: the residual stream as the embedding makes it, [batch, seq_len, D]."""
    w = model.embed.weight
    return torch.empty(batch, seq_len, w.shape[1], dtype=w.dtype, requires_grad=grad)


def _tables(model: MoEModel, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary tables for positions 0..seq_len-1, as its forward slices them."""
    return model.rope_cos[:seq_len], model.rope_sin[:seq_len]


def block_bytes(model: MoEModel, block: Block, batch: int, seq_len: int, bf16: bool,
                grad_in: bool = True) -> tuple[int, int]:
    """Bytes one of the fake model's blocks keeps for its backward at [batch, seq_len] tokens: (on
    the device, moved to host by model.offload) (module note). `grad_in`: whether its input
    requires a gradient (not in a LoRA run before the first trainable parameter)."""
    x = _stream(model, batch, seq_len, grad_in)
    cos, sin = _tables(model, seq_len)
    counter = block.offloader.counter if block.offloader else None
    moved = counter.bytes_to_host if counter else 0  # the model's blocks share one offloader
    # hash routing looks the experts up by token id: any ids do (the lookup saves nothing)
    ids = torch.zeros(batch, seq_len, dtype=torch.long) if model.cfg.moe.router.strategy == "hash" else None

    def run(x: torch.Tensor) -> Any:
        out = block(x, cos, sin, token_ids=ids)
        pack = _current_pack()
        for t in _held_outputs(out):
            pack(t)
        return out

    with _autocast(bf16), _checkpoints_count_inputs():
        device = saved_bytes(run, x, exclude=[*block.parameters(), *block.buffers(), cos, sin],
                             include_inputs=False).bytes
    return device, counter.bytes_to_host - moved if counter else 0


def head_bytes(model: MoEModel, batch: int, seq_len: int, bf16: bool) -> int:
    """The final norm, LM head and loss of a [batch, seq_len] micro-batch: their saved tensors (the
    last block's output among them only if an op saves it: the fused RMSNorm keeps its normalised
    copy instead, ops/rms_norm.py) and the logits the model returns (none in a LoRA run)."""
    x = _stream(model, batch, seq_len)
    targets = torch.zeros(batch * seq_len, dtype=torch.int64)

    def run(x: torch.Tensor) -> torch.Tensor:
        if model.lora is not None:  # a LoRA run's trainer: the loss in chunks, no logits (ops/head_loss.py)
            return head_loss(model.norm(x).view(batch * seq_len, -1), model.head.weight, targets)
        logits = model.head(model.norm(x))
        _current_pack()(logits)
        return F.cross_entropy(logits.float().view(batch * seq_len, -1), targets)

    with _autocast(bf16):
        params = [*model.norm.parameters(), *model.head.parameters()]
        return saved_bytes(run, x, exclude=params, include_inputs=False).bytes


def mtp_bytes(model: MoEModel, k: int, batch: int, seq_len: int, bf16: bool) -> int:
    """The model's k-th multi-token prediction module (layers/mtp.py), fed a hidden state of
    `seq_len` positions (module k: seq_len = S - k + 1; it runs on one position fewer): norms,
    projection, its block (dense, or MoE with model.mtp_block="moe", its experts run as one device
    runs them), head and loss. Its input (the main model's last hidden state, or
    the previous module's output) is counted where it was made."""
    module = model.mtp[k - 1]
    x = _stream(model, batch, seq_len)
    targets = torch.zeros(batch, seq_len, dtype=torch.int64)
    cos, sin = _tables(model, seq_len)

    def run(x: torch.Tensor) -> torch.Tensor:
        return mtp_loss(torch.nn.ModuleList([module]), x, targets, targets, model.embed, model.head, cos, sin)[0]

    params = [*module.parameters(), *model.embed.parameters(), *model.head.parameters(), cos, sin]
    with _autocast(bf16), _checkpoints_count_inputs():
        return saved_bytes(run, x, exclude=params, include_inputs=False).bytes


def expert_bytes(like: GroupedExperts, num_experts: int, rows: int, bf16: bool, local: bool = False) -> int:
    """What `num_experts` experts of the model's kind (`like`: its widths, activation and precision)
    keep for `rows` rows. `local`: as the one-device
    dispatcher runs them, with a row source (layers/dispatch.py): the lean experts keep a reference
    to the token rows and their indices (both counted where the block keeps them, so left out here)
    and no rows. Otherwise as the EP dispatcher runs them, without one: the lean experts keep the
    [rows, D] rows in the compute dtype (under autocast the cast copy, else the rows themselves),
    counted here."""
    _, width, _ = like.w_gate_up_EDF.shape  # LatentMoE: the experts' rows are latent rows
    experts = GroupedExperts(num_experts, width, like.w_down_EFD.shape[1], like.kind, like.clamp,
                             like.softcap, "grouped_mm", like.precision)
    if lora_layers.has_expert_adapters(like):  # train.lora: the adapters, as `like` has them
        lora_layers.add_expert_adapters(experts, like.lora_a1_EDr.shape[2], like.lora_scale)
    if like.dequant_base is not None:  # a frozen base held narrow (bf16 stand-in: module note)
        for p in (experts.w_gate_up_EDF, experts.w_down_EFD):
            p.requires_grad_(False)
        frozen_base.hold_frozen_base(experts, "bf16")
    x_RD = torch.empty(rows, width, requires_grad=True)
    w_R = torch.empty(rows, requires_grad=True)
    offsets = torch.full((num_experts,), rows, dtype=torch.int32)
    exclude = list(experts.parameters())
    source = None
    if local:
        source = RowSource(torch.empty(rows, width), torch.empty(rows, dtype=torch.int64), False)
        exclude += [source.x_TD, source.src_R]
    with _autocast(bf16):
        return saved_bytes(lambda x, w: experts(ExpertBatch(x, offsets, weights_R=w, source=source)), x_RD,
                           w_R, exclude=exclude, include_inputs=False).bytes


def experts_kept_on(cfg: ModelConfig) -> str:
    """Where the routed experts' saved tensors are during the backward: 'recomputed' (inside a
    `moe` or `layer` checkpoint: nowhere), 'host' (inside a `layer`, `moe` or `experts` offload
    scope) or 'device'."""
    if recompute_mod.modes_of(cfg.recompute) & {"layer", "moe"}:
        return "recomputed"
    if set(cfg.offload) & {"layer", "moe", "experts"}:
        return "host"
    return "device"


def activation_bytes(cfg: ModelConfig, batch: int, seq_len: int, bf16: bool,
                     ep_rows: tuple[int, int] | None = None, lora: LoRAConfig | None = None) -> ActivationBytes:
    """Per micro-batch on one rank. `ep_rows`: (local experts L, GEMM rows R) under expert
    parallelism, None on one device; `lora`: train.lora (module note)."""
    T = batch * seq_len
    with fake_world():
        model = MoEModel(cfg, lora=lora)
        moe_blocks = [b for b in model.blocks if b.is_moe]
        n_moe, n_dense = len(moe_blocks), cfg.n_layers - len(moe_blocks)
        delta = _ep_delta(cfg, moe_blocks, T, bf16, ep_rows)  # (device, host) per MoE block
        per_block: list[tuple[int, int]] = []
        if model.lora is None:  # every block alike: one of each kind
            kinds = {m: next((b for b in model.blocks if b.is_moe == m), None) for m in (False, True)}
            each = {m: block_bytes(model, b, batch, seq_len, bf16) if b is not None else (0, 0)
                    for m, b in kinds.items()}
        else:
            per_block = _lora_blocks(model, batch, seq_len, bf16, delta)
            each = {m: max([pb for b, pb in zip(model.blocks, per_block) if b.is_moe == m], default=(0, 0))
                    for m in (False, True)}
            delta = (0, 0)  # in per_block already
        (dense, dense_host), (moe, moe_host) = each[False], each[True]
        moe, moe_host = moe + delta[0], moe_host + delta[1]
        head = head_bytes(model, batch, seq_len, bf16)
        head += sum(mtp_bytes(model, k, batch, seq_len - k + 1, bf16) for k in range(1, len(model.mtp) + 1))
    return ActivationBytes(T, head, dense, moe, n_dense, n_moe,
                           dense_host, moe_host, tuple(per_block))


def _ep_delta(cfg: ModelConfig, moe_blocks: list[Block], T: int, bf16: bool,
              ep_rows: tuple[int, int] | None) -> tuple[int, int]:
    """(device, host) bytes expert parallelism adds to one MoE block (module note)."""
    where = experts_kept_on(cfg)
    if not moe_blocks or ep_rows is None or where == "recomputed":
        return 0, 0
    L, R = ep_rows
    layer = moe_blocks[0].ffn
    E, K = layer.slots.routed, cfg.moe.top_k
    # the rows the one-device plan gave the experts: every pair, each group padded to the
    # dispatcher's alignment (a low-precision token block: ops/permute.py's static bound)
    local_rows = T * K + E * (layer.dispatcher.align - 1)
    delta = expert_bytes(layer.experts, L, R, bf16) - expert_bytes(layer.experts, E, local_rows, bf16, local=True)
    return (0, delta) if where == "host" else (delta, 0)


def _lora_blocks(model: MoEModel, batch: int, seq_len: int, bf16: bool,
                 delta: tuple[int, int]) -> list[tuple[int, int]]:
    """(device, host) of every block of a LoRA model: a block keeps for the backward only what the
    gradients of the trainable parameters need, so it depends on whether its input requires a
    gradient (a trainable parameter before it: the embedding never trains) and which of its own
    parameters train; blocks alike in both are measured once. A block that computes no gradient keeps
    nothing but the outputs the model holds, and no expert rows under EP."""
    grad_in, seen, out = False, {}, []
    for b in model.blocks:
        trainable = tuple(n for n, p in b.named_parameters() if p.requires_grad)
        key = (b.is_moe, grad_in, trainable)
        if key not in seen:
            dev, host = block_bytes(model, b, batch, seq_len, bf16, grad_in)
            if b.is_moe and (grad_in or trainable):
                dev, host = dev + delta[0], host + delta[1]
            seen[key] = (dev, host)
        out.append(seen[key])
        grad_in = grad_in or bool(trainable)
    return out
