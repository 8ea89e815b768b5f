"""Expert-wise Muon: orthogonalised momentum for the matrices, AdamW for the rest, one optimizer object.

Design note
-----------
Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) replaces a matrix's update by the orthogonal
factor of its momentum: for M = U S V^T it steps along U V^T, every singular direction at the same
size, whatever the gradient's spectrum. The factor is approximated by a Newton-Schulz iteration, no
SVD:

    X <- M / (||M||_F + 1e-7)                 (every singular value now <= 1)
    5 times:  A = X X^T;  X <- a X + (b A + c A A) X      (a, b, c) = (3.4445, -4.7750, 2.0315)

run on the wide orientation (X transposed when it has more rows than columns, so A is the small
Gram matrix). These quintic coefficients (Jordan's) are tuned for speed, not convergence: they push
every singular value that is not tiny into a band around 1 (about 0.7 to 1.2) rather than onto 1,
which trains as well as the exact polar factor. The iteration runs in fp32 by default; `ns_dtype=bf16`
(`train.muon_ns_dtype`, "auto" = the forward's autocast dtype) runs it in bf16 as Jordan's code does,
but normalises in fp32 first; the 15 GEMMs per block run in bf16 (about 3-4x faster on a CPU with
AMX or on a GPU; without AMX a bf16 matmul runs at about half the fp32 speed, so "auto" keeps fp32
there), and the result stays in the fp32 band (tests/tolerances.py).

What is a matrix. Each 2-D weight in the sense of the layer that uses it, not of its storage:
* routed experts (`GroupedExperts`, [E, D, 2F] and [E, F, D]): each expert's slice separately, a
  batch of E matrices, so every expert's update has singular values near 1 on its own scale and an
  expert that got few tokens (a small, low-rank gradient) still moves as far as a busy one. One
  orthogonalisation of the whole [E*D, 2F] tensor would instead let the busy experts' gradients set
  the normalisation and the spectrum, and barely move the rest.
* prefused weights are split into the matrices they are: the gate and up halves of `w_gate_up_EDF`
  (last axis) and of a dense/shared `MLP.gate_up` (rows), and q, k, v of `Attention.qkv` (rows).
* embeddings, the LM head (tied or not), routers, norm gains and every bias go to AdamW, and so does
  any parameter of a module type not listed in `split_params` (a new layer is never orthogonalised by
  accident). The router's expert bias is a buffer: no optimizer touches it.

Update, per matrix block of shape (r, c) with fan-out r_out and fan-in c_in:

    m <- mu m + (1 - mu) g            (momentum buffer, mu = 0.95)
    u <- (1 - mu) g + mu m            (Nesterov: the lookahead)
    p <- p (1 - lr wd) - lr * scale * NS(u)

`scale` is the shape rule. Default `rms_match = 0.2`: scale = 0.2 sqrt(max(r, c)) (Moonlight), which
gives the update an RMS of about 0.2, AdamW's typical update RMS: the same `train.lr`, schedule and
weight decay then suit both halves of the optimizer, which is why it is the default (the seeds'
"extra scale of 0.2"). `rms_match=None`: scale = sqrt(max(1, r_out / c_in)) (Jordan's rule), an
update of RMS about 1/sqrt(max(r, c)) that wants its own, larger learning rate (around 0.02).

Everything else follows AdamW exactly (torch's formula, as in optim_lowp.AdamWBF16 but with fp32
moments): decay on >= 2-D parameters only, none on 1-D.

Sharding (FSDP2 + EP, distributed/parallelize.py). EP keeps E/ep whole experts per rank; FSDP2 then
shards dim 0 of every parameter. For the 3-D expert weights dim 0 is the expert axis, so each rank
holds whole experts and orthogonalises the experts it owns, locally: no communication, and exactly
the per-expert computation one process does. A 2-D weight sharded on its rows is not a matrix any
rank holds, and row blocks orthogonalised apart are not the orthogonal factor of the whole: it is
gathered (`DTensor.full_tensor`, one all-gather of the update, the size of the FSDP forward gather),
every rank runs the same iteration on the same data, and keeps its own rows (`distribute_tensor`
with `src_data_rank=None`: a local slice, no second collective). Every rank repeats the dense NS;
spreading whole matrices round-robin would save that for a scatter, not worth it at these sizes.

Skipping a step on the device. Like fused AdamW and AdamWBF16, `step()` reads an optional attribute
`found_inf` (float scalar tensor, 1.0 = skip): parameters, momenta, moments and step counts are left
bit-identical, decided with `torch.where`, no host read. The state is created eagerly in the
constructor (zero momenta, zero moments, step 0: what a first step would create), so a skipped first
step and a checkpoint taken before any step hold the same state as later ones.

torch.optim.Muon (torch 2.13) is the same maths for what it covers, a 2-D weight without blocks: the
momentum lerps and Nesterov lookahead, Newton-Schulz constants, decay lr wd, and `adjust_lr_fn`
"match_rms_adamw" / "original" = `rms_match` 0.2 / None (tests/train/test_muon_torch.py). Not used:
* it refuses any parameter that is not 2-D: the [E, D, F] experts, and this object's AdamW half (one
  object, so that one `found_inf` skips both; torch's has no such flag, and creates state lazily);
* its `_zeropower_via_newtonschulz` (private) takes one matrix: E experts would be E x 15 small GEMMs,
  not 15 batched ones; its shape rule reads the whole parameter, not a block (gate|up, q|k|v);
* it iterates in bf16 only (dropless defaults to fp32) and rounds elsewhere (tests/tolerances.py
  MUON_VS_TORCH_BF16): ~3.7% from dropless's bf16 factor, so it would change every bf16 run;
* on a row-sharded DTensor its GEMMs go through DTensor's dispatch, 11 all-reduces (tall) or 15
  all-gathers (wide) per matrix and step, where dropless gathers once.

Tensor names: m_* momentum, u_* Nesterov update, o_* orthogonalised update; *_BRC a batch of B
matrices of R rows and C columns (B = local experts, or 1 for a 2-D weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..layers.experts import GroupedExperts
from ..layers.mlp import MLP
from ..model import Attention
from ..ops.activations import is_gated
from .optim_lowp import step_prologue

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic, as torch.optim.Muon's: singular values to ~[0.7, 1.2]
NS_STEPS = 5
NS_EPS = 1e-7
MOMENTUM = 0.95
RMS_MATCH = 0.2


@dataclass(frozen=True)
class Split:
    """How one stored weight splits into the matrices Muon orthogonalises.

    batched: dim 0 is a batch of independent matrices (experts); the matrix is the last two dims.
    axis: the matrix axis (-2 rows, -1 columns) along which `sizes` cut the stored weight into blocks
    (gate|up, q|k|v); empty sizes = one block. out_axis: the fan-out axis (-2 for nn.Linear's
    [out, in], -1 for the experts' [in, out]), for the shape rule."""

    batched: bool = False
    axis: int = -2
    sizes: tuple[int, ...] = ()
    out_axis: int = -2


def split_params(model: nn.Module) -> dict[nn.Parameter, Split]:
    """The parameters Muon updates and how each splits; every other parameter is AdamW's."""
    out: dict[nn.Parameter, Split] = {}
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            if not hasattr(module, "w_gate_up_EDF"):  # a frozen base held packed (train.lora.base): no update
                continue
            w1 = module.w_gate_up_EDF
            half = (w1.shape[-1] // 2,) * 2 if is_gated(module.kind) else ()
            out[w1] = Split(batched=True, axis=-1, sizes=half, out_axis=-1)
            out[module.w_down_EFD] = Split(batched=True, out_axis=-1)
        elif isinstance(module, MLP):
            w = module.gate_up.weight
            out[w] = Split(sizes=(w.shape[0] // 2,) * 2 if is_gated(module.kind) else ())
            out[module.down.weight] = Split()
        elif isinstance(module, Attention):
            hd = module.head_dim
            out[module.qkv.weight] = Split(sizes=(module.n_heads * hd, module.n_kv_heads * hd,
                                                  module.n_kv_heads * hd))
            out[module.out.weight] = Split()
    return out


def newton_schulz(g_BRC: torch.Tensor, steps: int = NS_STEPS,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The quintic Newton-Schulz iteration on a batch of matrices [B, R, C], each on its own
    (its own Frobenius normalisation, its own Gram matrices). The normalisation is fp32; the iteration
    runs in `dtype` (fp32 or bf16); the result is fp32."""
    a, b, c = NS_COEFFS
    x = g_BRC.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = (x / (torch.linalg.matrix_norm(x, keepdim=True) + NS_EPS)).to(dtype)
    for _ in range(steps):
        a_BRR = x @ x.mT
        x = a * x + (b * a_BRR + c * (a_BRR @ a_BRR)) @ x
    x = x.float()
    return x.mT if tall else x


def scale_of(rows: int, cols: int, out_axis: int, rms_match: float | None) -> float:
    """The shape rule (module note) for one (rows, cols) block."""
    if rms_match is not None:
        return rms_match * math.sqrt(max(rows, cols))
    fan_out, fan_in = (rows, cols) if out_axis == -2 else (cols, rows)
    return math.sqrt(max(1.0, fan_out / fan_in))


def orthogonalise(u: torch.Tensor, split: Split, rms_match: float | None = RMS_MATCH,
                  ns_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The scaled orthogonalised update of one whole (unsharded, or whole-expert) weight: each
    expert and each block apart, in one batched iteration per block."""
    u_BRC = u if split.batched else u.unsqueeze(0)
    blocks = u_BRC.split(list(split.sizes), dim=split.axis) if split.sizes else (u_BRC,)
    outs = [newton_schulz(blk, dtype=ns_dtype) * scale_of(blk.shape[-2], blk.shape[-1], split.out_axis, rms_match)
            for blk in blocks]
    o_BRC = torch.cat(outs, dim=split.axis) if len(outs) > 1 else outs[0]
    return o_BRC if split.batched else o_BRC.squeeze(0)


def orthogonalise_reference(u: torch.Tensor, split: Split, rms_match: float | None = RMS_MATCH,
                            ns_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Plain specification of `orthogonalise`: a loop over experts and blocks, one 2-D iteration each."""
    mats = list(u) if split.batched else [u]
    done = []
    for m in mats:
        ax = split.axis % 2  # the same matrix axis, counted on a 2-D slice
        blocks = m.split(list(split.sizes), dim=ax) if split.sizes else (m,)
        done.append(torch.cat([newton_schulz(b.unsqueeze(0), dtype=ns_dtype)[0]
                               * scale_of(b.shape[0], b.shape[1], split.out_axis, rms_match)
                               for b in blocks], dim=ax))
    return torch.stack(done) if split.batched else done[0]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _orthogonalise_sharded(u: torch.Tensor, p: torch.Tensor, split: Split, rms_match: float | None,
                           ns_dtype: torch.dtype) -> torch.Tensor:
    """The local part of the update of `p` from the local part of its Nesterov update `u` (module
    note: experts locally, row-sharded matrices gathered)."""
    if not isinstance(p, DTensor):
        return orthogonalise(u, split, rms_match, ns_dtype)
    if split.batched and all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0) for pl in p.placements):
        return orthogonalise(u, split, rms_match, ns_dtype)  # whole experts on this rank
    full = DTensor.from_local(u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
    o = orthogonalise(full, split, rms_match, ns_dtype)
    return distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None).to_local()


class Muon(torch.optim.Optimizer):
    """Muon for the parameters in `splits` (param -> Split), AdamW for the other parameters of
    `params` (groups with a "muon" flag are built by `muon_param_groups`). Module note for the rules."""

    def __init__(self, params: list[dict], splits: dict[nn.Parameter, Split], lr: float = 1e-3,
                 momentum: float = MOMENTUM, rms_match: float | None = RMS_MATCH,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 ns_dtype: torch.dtype = torch.float32) -> None:
        if not lr >= 0:
            raise ValueError(f"lr={lr!r}: must be >= 0")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum={momentum!r}: must be in [0, 1)")
        if ns_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"ns_dtype={ns_dtype!r}: must be torch.float32 or torch.bfloat16")
        if rms_match is not None and not rms_match > 0:
            raise ValueError(f"rms_match={rms_match!r}: must be > 0 or None")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas!r}: each must be in [0, 1)")
        defaults = dict(lr=lr, momentum=momentum, betas=betas, eps=eps, weight_decay=weight_decay, muon=False)
        super().__init__(params, defaults)
        self.splits, self.rms_match, self.ns_dtype = splits, rms_match, ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if group["muon"] and p not in splits:
                    raise ValueError(f"a Muon group holds a parameter of shape {tuple(p.shape)} with no Split")
        self._init_state()

    @torch.no_grad()
    def _init_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    continue
                if group["muon"]:
                    self.state[p] = {"momentum_buffer": torch.zeros_like(p)}
                else:
                    self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                     "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss, found_inf, skip = step_prologue(self, closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32:
                    raise ValueError(f"Muon keeps fp32 weights; got a parameter of dtype {p.dtype}")
                if group["muon"]:
                    self._muon(p, group, skip)
                else:
                    self._adamw(p, group, found_inf, skip)
        return loss

    def _muon(self, p: torch.Tensor, group: dict, skip: torch.Tensor | None) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        buf = _local(self.state[p]["momentum_buffer"])
        g, w = _local(p.grad).float(), _local(p)
        m = buf.lerp(g, 1 - mu)
        u = g.lerp(m, mu)  # Nesterov
        o = _orthogonalise_sharded(u, p, self.splits[p], self.rms_match, self.ns_dtype)
        new_w = w * (1 - lr * wd)
        new_w -= lr * o
        if skip is not None:
            new_w, m = torch.where(skip, w, new_w), torch.where(skip, buf, m)
        w.copy_(new_w)
        buf.copy_(m)

    def _adamw(self, p: torch.Tensor, group: dict, found_inf: torch.Tensor | None,
               skip: torch.Tensor | None) -> None:
        """torch.optim.AdamW's update (the roundings of optim_lowp.AdamWBF16, fp32 moments)."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state = self.state[p]
        if not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]), device=p.device)
        # out of place: a state loaded from a live optimizer's state_dict shares its tensors
        state["step"] = state["step"] + (1 if found_inf is None else 1 - found_inf)
        t = _local(state["step"]).double()
        step_size = -lr / (1 - beta1 ** t)
        bias2_sqrt = (1 - beta2 ** t).sqrt()
        g, w = _local(p.grad).float(), _local(p)
        m_old, v_old = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        m = m_old.lerp(g, 1 - beta1)
        v = v_old * beta2
        v.addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias2_sqrt).add_(eps)
        new_w = w * (1 - lr * wd)
        new_w += m * step_size / denom
        if skip is not None:
            new_w, m, v = torch.where(skip, w, new_w), torch.where(skip, m_old, m), torch.where(skip, v_old, v)
        w.copy_(new_w)
        m_old.copy_(m)
        v_old.copy_(v)


def muon_param_groups(model: nn.Module, weight_decay: float) -> tuple[list[dict], dict[nn.Parameter, Split]]:
    """(groups, splits): Muon's matrices with decay; AdamW's >= 2-D parameters (embeddings, head,
    routers) with decay; AdamW's 1-D ones (norms, biases) without. Tied weights appear once."""
    splits = split_params(model)
    muon, decay, no_decay = [], [], []
    seen: set[int] = set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p in splits:
            muon.append(p)
        else:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": muon, "weight_decay": weight_decay, "muon": True},
              {"params": decay, "weight_decay": weight_decay, "muon": False},
              {"params": no_decay, "weight_decay": 0.0, "muon": False}]
    return [g for g in groups if g["params"]], splits
