"""Activation bytes per micro-batch, measured on fake tensors: what each block of the configured
shape keeps for its backward, under each recompute mode, without allocating it.

Legend: B sequences per micro-batch, S sequence length, T = B*S tokens, D model width, K experts
per token, E experts (L on this rank under expert parallelism), R rows of the expert GEMMs.

Why a measurement, not a formula: what a layer saves changes whenever someone changes the layer
(the lean MoE default removes whole [T*K, D] tensors); a hand formula would go stale silently. So
one block of each kind (dense, MoE) is built from the config and run forward on *fake tensors*
(`torch._subclasses.FakeTensorMode`: meta storage, no allocation, but the tensors claim to be on the
CPU, so CPU autocast casts them as in training and SDPA takes the CPU flash kernel, which keeps the
output and log-sum-exp as the GPU flash kernels do; on plain `meta` SDPA falls back to the math path
and would count an [S, S] matrix per head that no training run keeps). The count is
`dropless.saved_bytes.saved_bytes` (storages, once each, parameters excluded), plus two things
that are alive during the backward but that autograd does not "save":
- the inputs a recompute checkpoint keeps by reference (docs/memory.md: inside a checkpointed region
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
is a stand-in that records the storage's size and allocates nothing (`_HostCopyStandIn`).

Expert parallelism changes only the expert GEMMs' row count (R: the received rows, which in the
buffered mode are the fixed buffer of factor x the balanced need), so the MoE block is measured on one
device and its experts' share is replaced: minus the experts on the local T*K rows as the one-device
dispatcher runs them (with a row source: the lean experts keep a reference to the token rows, no
rows), plus the L local experts on R rows as the EP dispatcher runs them (no row source: the lean
experts keep the R received rows, D wide, in the compute dtype), both measured on fake tensors the
same way. The substitution goes where the
experts' saved tensors go: nowhere when the experts are recomputed (`moe`, `layer`: the recompute
repeats the all-to-alls and keeps no dispatched rows, docs/memory.md), into the host bytes when they
are offloaded (`layer`, `moe`, `experts`), else into the device bytes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..config import ModelConfig
from ..layers import offload as offload_mod
from ..layers import recompute as recompute_mod
from ..layers.experts import ExpertBatch, GroupedExperts
from ..layers.mtp import MTPModule, mtp_loss
from ..model import Block, RMSNorm, rotary_tables
from ..ops import grouped_gemm
from ..ops.lean_experts import RowSource
from ..saved_bytes import saved_bytes


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

    @property
    def host_total(self) -> int:
        return self.n_dense * self.dense_host + self.n_moe * self.moe_host

    @property
    def total(self) -> int:
        return self.head + self.n_dense * self.dense_block + self.n_moe * self.moe_block

    @property
    def per_token(self) -> float:
        return self.total / self.tokens


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _RegionReads(TorchDispatchMode):
    """Storages that ops read but that were not created inside the mode: a region's inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.created: set[int] = set()
        self.read: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and _key(t) not in self.created:
                self.read.setdefault(_key(t), t)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.created.add(_key(t))
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


class _GroupedMMStandIn(torch.autograd.Function):
    """fp32 grouped_mm on fake tensors: torch's meta kernel takes bf16 only (the CPU kernel takes
    fp32 too). Keeps what aten's grouped_mm keeps for its backward: both operands and the offsets."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(a, b, offs)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001
        raise RuntimeError("the planner's fake grouped_mm has no backward")


def _grouped_mm_any_dtype(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                          **kwargs: Any) -> torch.Tensor:
    if a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs, **kwargs)
    return _GroupedMMStandIn.apply(a, b, offs)


class _HostCopyStandIn:
    """layers/offload.py's host copy on fake tensors: the storage's size, nothing allocated (the
    real one would allocate a host storage of that size and copy a fake one into it)."""

    def __init__(self, t: torch.Tensor, stream: Any) -> None:
        self.device, self.nbytes, self.stream, self.restored = t.device, t.untyped_storage().nbytes(), None, None

    def restore(self) -> torch.UntypedStorage:
        raise RuntimeError("the planner's fake offload has no backward")


_real_pack = offload_mod.OffloadScope.pack


def _pack_fake(scope: offload_mod.OffloadScope, t: torch.Tensor) -> Any:
    """OffloadScope.pack for fake tensors. The real one leaves every tensor subclass in place (it
    moves plain tensors only), and on fake tensors every tensor is a FakeTensor: this takes a fake
    plain tensor as the real pack takes a plain one (parameters, their views and the keep tensors
    stay, each other storage is copied once) and counts it the same way."""
    if (type(t) is not FakeTensor or t.layout != torch.strided or t.device.type != "cpu"
            or _key(t) in scope.keep):
        return _real_pack(scope, t)  # a parameter (or a view of one) or a kept table: left in place
    count, key = scope.offloader.counter, _key(t)
    if key not in scope.copies:
        copy = offload_mod._HostCopy(t, None)
        scope.copies[key] = (copy, t.untyped_storage())
        count.storages += 1
        count.bytes_to_host += copy.nbytes
    count.tensors += 1
    return t  # no backward runs here


@contextlib.contextmanager
def fake_world() -> Iterator[None]:
    """Fake tensors on the 'cpu', with the grouped GEMM able to take fp32 there and the offload's
    host copies counted, not made."""
    real, real_copy = grouped_gemm._grouped_mm, offload_mod._HostCopy
    grouped_gemm._grouped_mm = _grouped_mm_any_dtype
    offload_mod._HostCopy = _HostCopyStandIn
    offload_mod.OffloadScope.pack = _pack_fake
    try:
        with FakeTensorMode():
            yield
    finally:
        grouped_gemm._grouped_mm = real
        offload_mod._HostCopy = real_copy
        offload_mod.OffloadScope.pack = _real_pack


def _autocast(bf16: bool) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", torch.bfloat16, enabled=bf16)


def _held_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of a block's MoEOutput, which ModelOutput.moe holds through the backward."""
    moe = getattr(out, "moe", None)
    if moe is None:
        return []
    return [t for f in fields(moe) for t in tree_flatten(getattr(moe, f.name))[0] if isinstance(t, torch.Tensor)]


def _plannable(cfg: ModelConfig) -> ModelConfig:
    """The config with the expert backend that runs on fake tensors: `loop` reads the group offsets
    on the host; grouped_mm keeps the same operands."""
    moe = cfg.moe
    if moe.capacity_factor is None and moe.backend in ("auto", "loop"):
        moe = replace(moe, backend="grouped_mm")
    return replace(cfg, moe=moe)


def block_bytes(cfg: ModelConfig, batch: int, seq_len: int, bf16: bool, moe: bool) -> tuple[int, int]:
    """Bytes one block keeps for its backward at [batch, seq_len] tokens: (on the device, moved to
    host by model.offload) (module note)."""
    cfg = _plannable(cfg)
    with fake_world():
        block = Block(cfg, moe=moe)
        x = torch.empty(batch, seq_len, cfg.d_model, requires_grad=True)  # the fp32 residual stream
        cos, sin = rotary_tables(seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)

        # hash routing looks the experts up by token id: any ids do (the lookup saves nothing)
        ids = torch.zeros(batch, seq_len, dtype=torch.long) if cfg.moe.router.strategy == "hash" else None

        def run(x: torch.Tensor) -> Any:
            out = block(x, cos, sin, token_ids=ids)
            pack = _current_pack()
            for t in _held_outputs(out):
                pack(t)
            return out

        with _autocast(bf16), _checkpoints_count_inputs():
            device = saved_bytes(run, x, exclude=[*block.parameters(), *block.buffers(), cos, sin],
                                 include_inputs=False).bytes
        return device, block.offloader.counter.bytes_to_host if block.offloader else 0


def head_bytes(cfg: ModelConfig, batch: int, seq_len: int, bf16: bool) -> int:
    """The final norm, LM head and loss of a [batch, seq_len] micro-batch: their saved tensors (the
    last block's output among them only if an op saves it: the fused RMSNorm keeps its normalised
    copy instead, ops/rms_norm.py) and the logits the model returns."""
    with fake_world():
        norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        head = torch.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        x = torch.empty(batch, seq_len, cfg.d_model, requires_grad=True)
        targets = torch.zeros(batch * seq_len, dtype=torch.int64)

        def run(x: torch.Tensor) -> torch.Tensor:
            logits = head(norm(x))
            _current_pack()(logits)
            return F.cross_entropy(logits.float().view(batch * seq_len, -1), targets)

        with _autocast(bf16):
            params = [*norm.parameters(), *head.parameters()]
            return saved_bytes(run, x, exclude=params, include_inputs=False).bytes


def mtp_bytes(cfg: ModelConfig, batch: int, seq_len: int, bf16: bool) -> int:
    """One multi-token prediction module (layers/mtp.py) fed a hidden state of `seq_len` positions
    (module k: seq_len = S - k + 1; it runs on one position fewer): norms, projection, its dense
    block, head and loss. Its input (the main model's last hidden state, or the previous module's
    output) is counted where it was made."""
    cfg = _plannable(cfg)
    with fake_world():
        module = MTPModule(cfg.d_model, Block(cfg, moe=False), lambda: RMSNorm(cfg.d_model, cfg.norm_eps))
        embed = torch.nn.Embedding(cfg.vocab_size, cfg.d_model)
        head = torch.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        x = torch.empty(batch, seq_len, cfg.d_model, requires_grad=True)
        targets = torch.zeros(batch, seq_len, dtype=torch.int64)
        cos, sin = rotary_tables(seq_len, cfg.head_width, cfg.rope_theta)

        def run(x: torch.Tensor) -> torch.Tensor:
            return mtp_loss(torch.nn.ModuleList([module]), x, targets, embed, head, cos, sin)

        params = [*module.parameters(), *embed.parameters(), *head.parameters(), cos, sin]
        with _autocast(bf16), _checkpoints_count_inputs():
            return saved_bytes(run, x, exclude=params, include_inputs=False).bytes


def expert_bytes(cfg: ModelConfig, num_experts: int, rows: int, bf16: bool, local: bool = False) -> int:
    """What the experts' GEMMs and activation keep for `rows` rows. `local`: as the one-device
    dispatcher runs them, with a row source (layers/dispatch.py): the lean experts keep a reference
    to the token rows and their indices (both counted where the block keeps them, so left out here)
    and no rows. Otherwise as the EP dispatcher runs them, without one: the lean experts keep the
    [rows, D] rows in the compute dtype (under autocast the cast copy, else the rows themselves),
    counted here."""
    moe = _plannable(cfg).moe
    width = moe.latent_dim or cfg.d_model  # LatentMoE: the experts' rows are latent rows
    with fake_world():
        experts = GroupedExperts(num_experts, width, moe.d_expert, moe.activation, moe.act_clamp,
                                 moe.act_softcap, moe.backend if moe.capacity_factor is None else "grouped_mm",
                                 moe.precision)
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
                     ep_rows: tuple[int, int] | None = None) -> ActivationBytes:
    """Per micro-batch on one rank. `ep_rows`: (local experts L, GEMM rows R) under expert
    parallelism, None on one device (module note)."""
    T = batch * seq_len
    n_moe = cfg.n_moe_layers
    n_dense = cfg.n_layers - n_moe  # the prefix and, with model.moe_layer_freq, the layers between
    dense, dense_host = block_bytes(cfg, batch, seq_len, bf16, moe=False) if n_dense else (0, 0)
    moe, moe_host = block_bytes(cfg, batch, seq_len, bf16, moe=True) if n_moe else (0, 0)
    where = experts_kept_on(cfg)
    if n_moe and ep_rows is not None and where != "recomputed":
        L, R = ep_rows
        E, K = cfg.moe.num_experts, cfg.moe.top_k
        delta = expert_bytes(cfg, L, R, bf16) - expert_bytes(cfg, E, T * K, bf16, local=True)
        if where == "host":
            moe_host += delta
        else:
            moe += delta
    head = head_bytes(cfg, batch, seq_len, bf16)
    head += sum(mtp_bytes(cfg, batch, seq_len - k + 1, bf16) for k in range(1, cfg.mtp_depth + 1))
    return ActivationBytes(T, head, dense, moe, n_dense, n_moe,
                           dense_host, moe_host)
