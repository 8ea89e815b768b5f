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

# Expert parallelism vs the single-process layer, fp32. Without de-dup no float is summed across ranks:
# each destination runs the grouped GEMM on exactly the rows (same order, same group sizes) that the
# single-process plan gives that expert, and the source combines in token order with the same code, so
# outputs, input gradients and expert-weight gradients are compared with torch.equal. Everything else
# is the noise floor of reordered fp32 sums: de-dup sums a token's pairs per rank, then over ranks (a
# different association of the same <= K terms), and replicated weights (router, shared experts) sum
# their gradient over ranks after each rank summed its own tokens (a different association of T terms).
# Both are a few ulps of the largest partial sum; 2e-6 relative to the tensor's largest entry.
EP_REDUCED = (2e-6, 2e-6)
