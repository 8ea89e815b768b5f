"""Every float tolerance the suite uses, with its reason. Index ops are compared with torch.equal.

Never widen an entry to make a test pass: find out why the numbers moved.
"""

from __future__ import annotations

import torch

# (rtol, atol) for comparing a fast path with its plain-PyTorch reference at the same dtype; atol is
# relative to the largest magnitude in the expected tensor (see assert_close).
# fp32: the fast path and the reference sum the same products in a different order (blocked GEMM vs
# per-token dot products; a K-way bmm vs a loop), so results differ by a few ulps of the largest
# partial sum: ~1e-7 relative per add, a few hundred adds -> 1e-5 covers it with margin. An element
# that is a sum with cancellation (a weight gradient over many rows) can be small while its error is
# set by the large terms it summed, hence the atol scaled by the tensor's largest entry.
# bf16: 8 mantissa bits, one rounding of each output (2^-8 = 4e-3) plus accumulation differences.
REFERENCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-12, 1e-14),
    torch.bfloat16: (2e-2, 2e-2),
}

# E=1, K=1 against a dense MLP with the same weights: the same GEMMs on the same rows, only the
# permutation (an identity) and a multiply by weight 1.0 in between; the GEMM kernels may still block
# differently for a grouped vs a plain matmul, so allow one fp32 rounding step.
DENSE_EQUIV = (1e-6, 1e-6)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float] | None = None,
                 msg: str = "") -> None:
    rtol, atol = tol if tol is not None else REFERENCE[expected.dtype]
    atol = atol * max(1.0, float(expected.detach().abs().max())) if expected.numel() else atol
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{msg}: {m}")

# Low-precision expert GEMMs (ops.quant_gemm) against the full-precision layer: a loose error floor,
# not a parity check. Each quantised operand carries a relative rms error of 10^(-SQNR/20); the floors
# below are the per-operand SQNR floors of tests/ops/test_quant.py (x ~ N(0, 1), measured values ~2 dB
# higher). A layer output chains four quantised operands through two GEMMs and the gated activation,
# which multiplies two noisy GEMM outputs, and a gradient chains as many again, so errors add in
# quadrature over roughly six to nine terms: relative error <= 3 * 10^(-SQNR/20). Measured relative
# Frobenius errors at d=128, f=128, E=4, K=2, T=256 (torch 2.13 CPU), output and worst gradient:
# mxfp8 0.079 / 0.092, fp8_blockwise 0.064 / 0.065, nvfp4 0.235 / 0.247, mxfp4 0.305 / 0.306;
# i.e. about 2.6x the per-operand error, under the 3x bound.
LOWP_OPERAND_SQNR_DB = {"mxfp8": 28.5, "fp8_blockwise": 30.0, "nvfp4": 18.5, "mxfp4": 17.0}
LOWP_PATH_FACTOR = 3.0


def lowp_layer_rel_err(precision: str) -> float:
    return LOWP_PATH_FACTOR * 10 ** (-LOWP_OPERAND_SQNR_DB[precision] / 20)


# AdamWBF16 against torch.optim.AdamW, 50 steps, lr 1e-2, beta2 0.999: the bf16 run's displacement from the
# initial weights must match torch's to this relative (Frobenius) error. Each stored moment carries a
# bf16 rounding error (<= 2^-9 = 0.2% relative) that is not forgotten: exp_avg keeps ~1/(1-beta1^2) ~ 5
# roundings alive (~0.45% rms), exp_avg_sq with beta2 = 0.999 keeps all t of them (~sqrt(t/3) * 2^-9 / sqrt(3)
# ~ 0.5% at t = 50, halved by the sqrt). So every update m / sqrt(v) is off by ~0.5-1%, and the errors are
# correlated from step to step (they live in the state), so the displacement is off by the same relative
# amount rather than averaging out. Measured: 0.42% (nearest), 0.56-0.62% (stochastic, 3 seeds); a wrong
# formula (bias correction, decay) is off by tens of percent.
ADAMW_BF16_REL_DISPLACEMENT = 0.02

# Expert parallelism vs the single-process layer, fp32: every float result (outputs, input gradients,
# expert-weight gradients, the replicated router and shared-expert gradients) at the noise floor of
# reordered fp32 sums, never torch.equal. Why not bit-exact, even without de-dup: an EP rank runs its
# GEMMs (the router's logits, each expert's grouped GEMM, the weight-gradient reductions over rows) on
# a slice of the batch, and the BLAS (MKL here) rounds a row of an fp32 GEMM differently depending on
# more than the row: the number of rows around it, their alignment, and the kernel path picked for the
# CPU (AVX-512, AVX2, AMX machines). Measured on torch 2.13 CPU: a router row of a 12-token batch differs
# by 9.5e-7 from the same row in its 6-token half on an AMX machine's default path, while under
# MKL_ENABLE_INSTRUCTIONS=AVX2 a plain mm row differs by up to 4.8e-7 between batches of 2..9 and 1000
# rows; the EP parity suite saw 6e-8..4.8e-7 differences depending on the machine (issue 10). Beyond
# that, de-dup sums a token's pairs per rank, then over ranks (a different association of the same
# <= K terms), and replicated weights sum their gradient over ranks after each rank summed its own
# tokens (a different association of T terms). All of it is a few ulps of the largest partial sum;
# 2e-6 relative to the tensor's largest entry. A rerun of the same configuration on the same machine is
# still bit-identical (tests/train: reruns and resume compare with torch.equal on one process).
EP_REDUCED = (2e-6, 2e-6)

# Distributed training (EP + FSDP2, 4 gloo ranks, fp32) against one process with 4x the gradient
# accumulation, over 20 steps of the tiny config (tests/distributed/test_parallel_train.py). The data are
# identical; what differs is the association of fp32 sums: FSDP reduce-scatters per-rank gradient sums
# where one process accumulates micro-batch by micro-batch, de-dup sums a token's expert outputs per rank
# first, the logged loss is a mean of rank means. Measured: loss within 9.5e-8 relative (one fp32 ulp at
# loss 3.6 is 6.6e-8), gradient norm within 4.4e-6 (a sum of squares over 35k gradient entries that
# already carry a few ulps of weight difference per step). Relative bounds, about 10x and 20x the
# measurement. They must stay tight: AdamW is nearly invariant to the scale of a gradient, so a wrong
# gradient scale (experts not divided by ep, measured) moves the loss by only 2e-5 in 20 steps.
PARALLEL_TRAIN_LOSS = 1e-6
PARALLEL_TRAIN_GRAD_NORM = 1e-4

# torch.compile(backend="aot_eager", fullgraph=True) against eager, the MoE layer on CPU
# (tests/test_compile.py). aot_eager runs the traced ATen graph with the eager kernels, so with bf16
# weights the two agree to the bit (measured: 0 difference, every strategy tested). Under bf16 autocast
# with fp32 weights (the trainer's setting) AOTAutograd traces the backward of our autograd functions
# with the forward's autocast state on, where eager runs the backward outside it, so a few backward
# products round to bf16 at other points: measured up to 2.9e-3 of the largest entry (input gradient)
# and 2.5e-3 (router weight gradient), i.e. one bf16 rounding (2^-8 = 3.9e-3); eager with its backward
# inside autocast matches the compiled graph to the bit. 1e-2 allows ~2.5 roundings; a wrong gradient
# formula is off by O(1).
COMPILED = (1e-2, 1e-2)
