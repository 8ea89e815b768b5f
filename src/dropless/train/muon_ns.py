"""Muon's orthogonalisation: the Newton-Schulz iteration, the shape rule, and the batching of
same-shape matrices (train/muon.py has the optimizer and the design note).

Tensor names: u_* Nesterov update, o_* orthogonalised update; *_BRC a batch of B matrices of R rows
and C columns.

Batching (`orthogonalise_many`). Every block of every parameter is an independent matrix with its
own normalisation and Gram matrices, so which matrices share a batched product changes nothing but
roundings the BLAS may place by batch size: in bf16 (oneDNN) none, bit for bit under its AMX, AVX-512
and AVX2 paths; in fp32 none on MKL's AMX and AVX-512 paths, and on its AVX2 path of an AMX Xeon up
to 1.3e-6 on entries of ~0.1 (tests/train/test_muon.py: `torch.equal` in bf16, REFERENCE in fp32).
What it changes is the speed, and the best batch differs by device:
* CUDA: one launch per product for all same-shape matrices of a bucket of parameters (the experts
  of every layer, the gate and up halves, q, k, v and the output projection when square): 15
  launches per shape instead of 15 per block. A bucket holds at most `BUCKET_BYTES` of updates (the
  stacked copy is the transient), so a large model never stacks all its matrices at once.
* CPU: about 1 MiB of matrices (in the iteration's dtype) per call (`CPU_CHUNK_BYTES`), so that a
  chunk and its Gram products stay in cache. Measured on quiet machines, 48 matrices of 256 x 256,
  seconds by matrices per call:
      fp32, 2-core AMD EPYC, AVX2 only
      threads   1      2      4      8      16     48
      2         0.241  0.183  0.175  0.181  0.190  0.224
      1         0.320  0.308  0.326  0.349  0.365  0.411
      bf16 (the baddbmm form), 2-core CPU with amx_bf16 amx_tile avx512_bf16
      2         0.053  0.022  0.021  0.022  0.017  0.022
      1         0.055  0.032  0.028  0.029  0.028  0.031
  and 48 of 128 x 128 at 2 threads in fp32: 0.090 one by one, 0.033 by 8 or 16. The budget gives 4
  fp32 or 8 bf16 matrices at 256 x 256 and 16 fp32 at 128 x 128. Parameters are taken one by one
  (no bucket), which keeps the CPU's transient at one parameter's update, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic, as torch.optim.Muon's: singular values to ~[0.7, 1.2]
NS_STEPS = 5
NS_EPS = 1e-7
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
    fused = dtype == torch.bfloat16
    for _ in range(steps):
        a_BRR = x @ x.mT
        if fused:
            # bf16: the scalings ride in the GEMMs (beta * C + alpha * A @ B, one kernel: torch.optim.
            # Muon's addmm form) instead of four element-wise passes a matrix, which on the CPU cost
            # more than the bf16 products (module note), and each output is rounded once, not thrice.
            # fp32 keeps the separate ops: MKL's batched GEMM with a beta term rounds a matrix
            # differently by batch size even on its AMX and AVX-512 paths, where the plain
            # products do not (module note).
            x = torch.baddbmm(x, torch.baddbmm(a_BRR, a_BRR, a_BRR, beta=b, alpha=c), x, beta=a)
        else:
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
    expert and each block apart (`orthogonalise_many` of one weight, all of a shape at once)."""
    return orthogonalise_many([u], [split], rms_match, ns_dtype)[0]


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




# the most bytes of fp32 updates stacked into one bucket's batches (module note); 0: parameter by parameter
BUCKET_BYTES = {"cuda": 256 * 2**20}


def bucket_bytes(device: torch.device) -> int:
    return BUCKET_BYTES.get(device.type, 0)


CPU_CHUNK_BYTES = 2**20  # bytes of matrices (in the iteration's dtype) per Newton-Schulz call on the CPU (module note)


def ns_chunk_bytes(device: torch.device) -> int | None:
    """Bytes of matrices per Newton-Schulz call (module note): about 1 MiB on the CPU, all of a shape
    elsewhere (None)."""
    return CPU_CHUNK_BYTES if device.type == "cpu" else None


def orthogonalise_many(us: list[torch.Tensor], splits: list[Split], rms_match: float | None = RMS_MATCH,
                       ns_dtype: torch.dtype = torch.float32, chunk_bytes: int | None = None) -> list[torch.Tensor]:
    """[orthogonalise(u, split) for each] (the same bits where the BLAS allows: module note), with
    the blocks of all of them grouped by shape (wide orientation) and each group iterated
    `chunk_bytes` of matrices (in `ns_dtype`) at a time (at least one matrix; None: all at once)."""
    groups: dict[tuple[int, int], list[tuple[int, int, bool, torch.Tensor]]] = {}
    n_blocks = []
    for i, (u, split) in enumerate(zip(us, splits)):
        u_BRC = (u if split.batched else u.unsqueeze(0)).float()
        blocks = u_BRC.split(list(split.sizes), dim=split.axis) if split.sizes else (u_BRC,)
        n_blocks.append(len(blocks))
        for j, blk in enumerate(blocks):
            tall = blk.shape[-2] > blk.shape[-1]
            wide = blk.mT if tall else blk
            groups.setdefault((wide.shape[-2], wide.shape[-1]), []).append((i, j, tall, wide))
    done: dict[tuple[int, int], torch.Tensor] = {}
    item = torch.finfo(ns_dtype).bits // 8  # bytes of one element of the iteration's matrices
    for items in groups.values():
        # contiguous wide matrices whatever the batch (a transposed or sliced view would take other
        # GEMM and reduction paths: other bits)
        stacked = torch.cat([w for *_, w in items])
        step = max(stacked.shape[0], 1) if chunk_bytes is None else \
            max(1, chunk_bytes // (item * stacked.shape[-2] * stacked.shape[-1]))
        o = torch.cat([newton_schulz(part, dtype=ns_dtype) for part in stacked.split(step)]) \
            if stacked.shape[0] else newton_schulz(stacked, dtype=ns_dtype)
        for (i, j, tall, w), o_BRC in zip(items, o.split([w.shape[0] for *_, w in items])):
            done[i, j] = o_BRC.mT if tall else o_BRC
    out = []
    for i, (u, split) in enumerate(zip(us, splits)):
        outs = [done[i, j] * scale_of(done[i, j].shape[-2], done[i, j].shape[-1], split.out_axis, rms_match)
                for j in range(n_blocks[i])]
        o_BRC = torch.cat(outs, dim=split.axis) if len(outs) > 1 else outs[0]
        out.append(o_BRC if split.batched else o_BRC.squeeze(0))
    return out
