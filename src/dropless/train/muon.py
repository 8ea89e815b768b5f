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
which trains as well as the exact polar factor. `ns_dtype=bf16` runs the iteration in bf16 as Jordan's
code does, but normalises in fp32 first; the 15 GEMMs per block run in bf16 (about 3-4x faster on a
CPU with AMX or on a GPU; without AMX a bf16 matmul runs at about half the fp32 speed), with the
scalings inside the GEMMs (torch.optim.Muon's addmm form), and the result stays in the fp32 band
(tests/tolerances.py). The trainer's default, `train.muon_ns_dtype = "auto"`, follows the forward's
autocast dtype: bf16 on CUDA and AMX CPUs, fp32 elsewhere.

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

Batching (muon_ns.py): the matrices of one shape share the Newton-Schulz iterations (CUDA: every
parameter of a bucket of updates; the CPU: about 1 MiB of matrices at a time, which stays in cache). Each
matrix is iterated on its own either way, so the batching changes at most where the BLAS rounds
(muon_ns.py: no bits in bf16, fp32 noise on one MKL path).

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

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..layers.experts import GroupedExperts
from ..layers.mlp import MLP
from ..model import Attention
from ..ops.activations import is_gated
from .muon_ns import (NS_COEFFS, NS_EPS, NS_STEPS, RMS_MATCH, Split, bucket_bytes, newton_schulz, ns_chunk_bytes,
                      orthogonalise, orthogonalise_many, orthogonalise_reference, scale_of)
from .optim_lowp import step_prologue

# the Newton-Schulz names are muon_ns.py's, re-exported: this module is where callers find Muon's maths
__all__ = ["MOMENTUM", "Muon", "NS_COEFFS", "NS_EPS", "NS_STEPS", "RMS_MATCH", "Split", "muon_param_groups",
           "newton_schulz", "orthogonalise", "orthogonalise_many", "orthogonalise_reference", "scale_of",
           "split_params"]
MOMENTUM = 0.95


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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _gathered(u: torch.Tensor, p: torch.Tensor, split: Split) -> torch.Tensor:
    """What `orthogonalise` takes for `p` from the local part of its update `u` (module note): the
    local experts as they are, a row-sharded matrix gathered whole (one all-gather)."""
    if not isinstance(p, DTensor):
        return u
    if split.batched and all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0) for pl in p.placements):
        return u  # whole experts on this rank
    return DTensor.from_local(u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()


def _local_part(o: torch.Tensor, p: torch.Tensor, gathered: bool) -> torch.Tensor:
    """This rank's rows of the orthogonalised update `o` of `p` (whole when `_gathered` gathered it)."""
    if not gathered:
        return o
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
        """AdamW's parameters one by one; Muon's in buckets whose same-shape matrices share the
        Newton-Schulz iterations (muon_ns.py: on the CPU a bucket is one parameter)."""
        loss, found_inf, skip = step_prologue(self, closure)
        bucket: list[tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]] = []
        held = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32:
                    raise ValueError(f"Muon keeps fp32 weights; got a parameter of dtype {p.dtype}")
                if not group["muon"]:
                    self._adamw(p, group, found_inf, skip)
                    continue
                u = self._momentum(p, group, skip)
                bucket.append((p, group, u, _gathered(u, p, self.splits[p])))
                held += bucket[-1][3].numel() * 4
                if held >= bucket_bytes(u.device):
                    self._muon_update(bucket, skip)
                    bucket, held = [], 0
        if bucket:
            self._muon_update(bucket, skip)
        return loss

    def _momentum(self, p: torch.Tensor, group: dict, skip: torch.Tensor | None) -> torch.Tensor:
        """The momentum buffer stepped (kept on a skipped step); returns the local Nesterov update."""
        mu = group["momentum"]
        buf = _local(self.state[p]["momentum_buffer"])
        g = _local(p.grad).float()
        m = buf.lerp(g, 1 - mu)
        u = g.lerp(m, mu)  # Nesterov
        buf.copy_(m if skip is None else torch.where(skip, buf, m))
        return u

    def _muon_update(self, bucket: list[tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]],
                     skip: torch.Tensor | None) -> None:
        """p <- p (1 - lr wd) - lr O(u) for each (p, group, local u, u to orthogonalise) of the bucket."""
        device = bucket[0][2].device
        # traced (train.compile=step): all of a shape at once, so the graph holds 15 products per
        # shape instead of 15 per matrix (the same bits: muon_ns.py)
        chunk = None if torch.compiler.is_compiling() else ns_chunk_bytes(device)
        os = orthogonalise_many([full for *_, full in bucket], [self.splits[p] for p, *_ in bucket],
                                self.rms_match, self.ns_dtype, chunk)
        for (p, group, u, full), o in zip(bucket, os):
            lr, wd = group["lr"], group["weight_decay"]
            w = _local(p)
            new_w = w * (1 - lr * wd)
            new_w -= lr * _local_part(o, p, gathered=full is not u)
            w.copy_(new_w if skip is None else torch.where(skip, w, new_w))

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
