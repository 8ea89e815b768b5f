"""Every float tolerance the suite uses, with its reason. Index ops are compared with torch.equal.

Never widen an entry to make a test pass: find out why the numbers moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    """An elementwise bound: |actual - expected| <= rtol * S + atol on every element, where S is
    |expected|, or the magnitude of the terms the element sums (`terms=` of assert_close) when the
    caller knows it. atol is an absolute floor in the units of the data, not a fraction of the
    tensor's largest entry: a small element is held to its own size, so it cannot be entirely wrong
    beside large ones."""

    rtol: float
    atol: float


# Comparing a fast path with its plain-PyTorch reference at the same dtype. Every test that uses
# these feeds O(1) data (randn inputs, default-init weights; gradients up to ~16), which is what the
# absolute floors assume: data at another scale needs `terms=` or fails, it never passes silently.
# fp32: the fast path and the reference sum the same products in a different order (blocked GEMM vs
#   per-token dot products, a K-way bmm vs a loop), so they differ by a few ulps of the largest
#   partial sum. rtol 1e-5: ~170 unit roundoffs (u = 6e-8) of the element itself, for sums
#   without cancellation. atol 5e-6: an element that is a sum with cancellation (a weight gradient over the
#   batch, a router gradient through the softmax backward) can be small while its rounding is set by
#   the terms it summed: 5e-6 is ~5 ulps of terms of size ~10 (ulp 9.5e-7) whatever the result; measured
#   worst 1.7e-6 (tests/test_moe_layer.py, prime_E, router weight gradient, largest entry 9.6).
# fp64: the same argument at u = 1.1e-16.
# bf16: both sides read the same bf16 operands, accumulate in fp32 and round the result to bf16 once,
#   so they agree to one bf16 rounding of the element (2^-8 = 0.4% relative) when the fp32 sums differ
#   across a rounding boundary; 2e-2 is five of those. atol 1e-3: one rounding (2^-9) of an O(1)
#   intermediate that cancels to near zero. A bf16 sum with cancellation whose intermediates are
#   rounded to bf16 differently on the two sides (weighted SwiGLU's routing-weight gradient, the
#   de-dup weight gradient) is compared with `terms=` (sum of |terms|, whose rounding it inherits).
REFERENCE = {
    torch.float32: Tol(1e-5, 5e-6),
    torch.float64: Tol(1e-12, 1e-14),
    torch.bfloat16: Tol(2e-2, 1e-3),
}

# E=1, K=1 against a dense MLP with the same weights: the same GEMMs on the same rows, only the
# permutation (an identity) and a multiply by weight 1.0 in between; the GEMM kernels may still block
# differently for a grouped vs a plain matmul, so allow about one fp32 rounding step of each element
# (rtol 1e-6 = 8 ulps) and of an O(1) element that cancels to near zero (atol 1e-7 ~ 1 ulp of 1.0).
DENSE_EQUIV = Tol(1e-6, 1e-7)

# The MoE layer in bf16 (experts, input and output; the router stays fp32) against the same layer in
# fp32, on data where no token's expert choice flips. bf16 rounds the input and the expert weights
# (2^-9 relative each), the hidden activation and the output: about five roundings of 2^-9, each
# relative to the terms an output element sums (K experts x F products, with cancellation), so the
# bound is taken on max(|y|, sum of |terms|). Measured worst |error| / terms 1.2% (4 seeds, d=32,
# E=8, K=2, F=16); 3e-2 is 2.5x that. atol: one bf16 rounding of an O(1) value.
BF16_VS_FP32 = Tol(3e-2, 1e-3)

# The capacity layout against the dropless one when nothing drops (tests/test_capacity_and_config.py):
# the same rows meet the same weights, but each expert's GEMM runs over C rows (its pairs plus zero
# padding) instead of its count, and the padded bmm blocks differently from the grouped GEMM. The BLAS
# rounds a row by the rows around it and the kernel path (see EP_REDUCED): measured 0 on the default
# and MKL_ENABLE_INSTRUCTIONS=AVX512 paths of an AMX machine, up to 2.6e-7 of the largest output under
# AVX2 (20 seeds, every backend). One fp32 rounding step of the largest entry, with 4x margin.
CAPACITY_EQUIV = (1e-6, 1e-6)

# The layer in bf16 on a CUDA device against the same layer in bf16 on the CPU, same weights, same
# (replayed) expert choices (tests/test_cuda.py). The two devices' GEMM kernels accumulate in fp32 in
# different orders, and each rounds every GEMM output and the activation to bf16: where one
# intermediate lands on the other side of a bf16 rounding boundary (2^-8 relative), the next GEMM
# carries that difference into every element of the row, so the error follows the row's magnitude,
# not the element's (an element near zero can be off by a rounding of its neighbours). Hence the
# (rtol, atol x largest entry) form: 2e-2 is five bf16 roundings. First H200 run (torch 2.11, fp32
# elementwise bound): y off by 7.8e-3 at 0.47 and 1.6e-2 at 2.06, i.e. 2-4 bf16 ulps.
CUDA_VS_CPU_BF16 = (2e-2, 2e-2)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tol | tuple[float, float] | None = None,
                 msg: str = "", *, terms: torch.Tensor | None = None) -> None:
    """`tol` a Tol (default REFERENCE[expected.dtype]): the elementwise bound its docstring states,
    with S = max(|expected|, terms) when `terms` (broadcastable, the sum of |terms| each element adds
    up) is given. `tol` a plain (rtol, atol) pair: atol is relative to the largest entry of
    `expected` (times max(1, max|expected|)), the form EP_REDUCED's reason is written in; weaker on
    small elements, so not for new tolerances."""
    tol = tol if tol is not None else REFERENCE[expected.dtype]
    if not isinstance(tol, Tol):
        rtol, atol = tol
        atol = atol * max(1.0, float(expected.detach().abs().max())) if expected.numel() else atol
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{msg}: {m}")
        return
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().double(), expected.detach().double()
    scale = e.abs() if terms is None else torch.maximum(e.abs(), terms.detach().double().abs())
    bound = tol.rtol * scale + tol.atol
    err = (a - e).abs()
    bad = ~(err <= bound) & (a != e)  # a != e: equal infinities pass; NaN always fails
    if bool(bad.any()):
        i = int(torch.argmax(torch.where(bad, err / bound, -1.0)))
        idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), e.shape)) if e.dim() else ()
        raise AssertionError(
            f"{msg}: {int(bad.sum())} of {e.numel()} elements outside |a - e| <= {tol.rtol:g} * "
            f"{'max(|e|, terms)' if terms is not None else '|e|'} + {tol.atol:g}; worst at {idx}: "
            f"actual {float(a.reshape(-1)[i]):.8g}, expected {float(e.reshape(-1)[i]):.8g}, "
            f"error {float(err.reshape(-1)[i]):.3g} > bound {float(bound.reshape(-1)[i]):.3g}")


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
# rows; the EP parity suite saw 6e-8..4.8e-7 differences depending on the machine. Beyond
# that, de-dup sums a token's pairs per rank, then over ranks (a different association of the same
# <= K terms), and replicated weights sum their gradient over ranks after each rank summed its own
# tokens (a different association of T terms). All of it is a few ulps of the largest partial sum;
# 2e-6 relative to the tensor's largest entry. A rerun of the same configuration on the same machine is
# still bit-identical (tests/train: reruns and resume compare with torch.equal on one process).
EP_REDUCED = (2e-6, 2e-6)

# Expert parallelism vs the single-process layer with low-precision expert GEMMs (ops.quant_gemm):
# the same floor as EP_REDUCED, not the quantisation floor, because every quantised operand is the
# same bits in both runs. An EP destination lays out expert e's rows exactly as the one-process plan
# does on the global batch (source-major = token order, padded to the token block at the group end),
# so every block-scaled operand (x and dy along D, their 32-token wgrad blocks, the per-expert
# weights) sees the same numbers, and the emulated GEMM multiplies the same matrices per expert. The
# one input that would differ is the routing weight (the router's fp32 GEMM on a slice vs the whole
# batch: see EP_REDUCED), and a weight one ulp off can move an activation across an E4M3 rounding
# boundary, a whole quantum (~6%) at once; the test feeds the router exact dyadic inputs (every logit
# an exact sum in any order), so the weights are the same bits too. What remains is the EP
# re-association of sums after the last quantisation (de-dup's per-rank sums, the replicated router's
# gradient over ranks, the input gradient over ranks): fp32 noise.
EP_LOWP = EP_REDUCED

# A low-precision dispatch payload (parallel.dispatch_dtype) sends the gradient of every received row
# back in bf16: each pair's gradient row is rounded once to bf16 (relative error <= 2^-9), and a token
# sums its K pairs' rows, which may cancel, so the bound is taken relative to the tensor's largest
# entry as well as the entry: 2^-8 of either (twice the rounding, for the sum of two roundings at k=2).
# The same for a replicated weight whose gradient passes through those rows (the shared experts' input
# gradient does not, but their weights' gradient is read from rows that did not cross: exact). Anything
# rounded more coarsely than bf16 (an fp8 gradient, a lost row) is off by 2^-4 or more.
EP_GRAD_WIRE_BF16 = 2.0**-8

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

# Pipeline stages against one process (tests/distributed/test_pipeline.py): every gradient element
# and the loss-free bias after each of 3 AdamW steps (lr 1e-2, clipped), fp32, pp 2 with every schedule
# and pp 2 x edp 2, pp 2 x ep 2. Same data, same micro-batches; what differs is where fp32 sums are
# cut: the global norm is a sum of per-rank squares (clip_grad_norm_ takes a norm of per-tensor norms,
# 2e-7 relative apart at step 0, so every clipped gradient moves by that), FSDP and EP re-associate as
# in PARALLEL_TRAIN_*, and from step 1 AdamW's per-element normalisation carries each weight's few-ulp
# difference into the next gradients. The fp32 REFERENCE bound; measured worst, as a fraction of it:
# 0.002 at step 0, 0.025 at step 1, 0.22 at step 2 (pp 2 x ep 2; zbv 0.20); the multi-token prediction,
# hash routing and parallel-block cases within those (worst 0.16 at step 2, hash). The bias is bit-identical
# (the sign rule on identical integer counts). A stage's aux loss missing, or read against local
# counts, moves router gradients by ~1e-4 absolute: 20x the floor.
PIPELINE = REFERENCE[torch.float32]

# LoRA under EP + FSDP2 against one process (tests/distributed/test_lora_ep.py): the adapters and the
# trained router after 6 steps of the tiny run (fp32, lr 1e-2), elementwise, in weight units (entries
# up to 0.43, ulp 3e-8 there). The same re-associated sums as above reach each gradient element; AdamW
# divides each by its own running rms, so an element's update carries its gradient's relative rounding
# (a few ulps, more where the element's sum cancels) times lr, every step, and the steps add up.
# Measured worst: 3.6e-7 (EP 2, buffered), 1.6e-7 (EP 4), 4.6e-7 (EP 2 x edp 2), 5.1e-7 (resumed from
# EP 4 at EP 2 against the uninterrupted EP-2 run). 5e-6 is 10x. An adapter trained or loaded on the
# wrong expert is off by its whole value (~0.1), an update of the wrong sign by 2 lr.
PARALLEL_TRAIN_ADAPTERS = Tol(0.0, 5e-6)

# A packed 4-bit run's validation loss against its unquantised run (`dropless quantize`, fp32
# evaluation): only the routed experts' weights change, each by its 4-bit rounding (the per-operand
# floors above), and on the tiny config two steps from initialisation the experts add little to the
# residual stream, so the loss barely moves. Measured (LatentMoE d=64, l=32, seeds 0..2, two
# validation batches): 4.0e-4 to 1.1e-3 relative for mxfp4 and nvfp4. 1e-2 is ~10x; that the packed
# experts compute the right numbers is checked exactly, against the fake-quantised model's logits.
PACKED_VAL_LOSS = 1e-2


# fp32 GEMM results that the BLAS may round differently: the same operands at another memory
# alignment, in a batch of another size, or on another kernel path (MKL picks AMX / AVX-512 / AVX2 code
# by CPU; MKL_ENABLE_INSTRUCTIONS forces one). A dot product of n terms summed in another order differs
# by at most (n-1) ulps of the running sum, in practice a few; the bound is per element, scaled by the
# magnitude of the terms it sums, (|A| @ |B|)[i, j], so a small element made of small terms is held
# as tightly as a large one (a per-tensor max scale would let it be entirely wrong). Measured: the
# fp8_blockwise wgrad of tests/ops/test_quant_gemm.py under MKL_ENABLE_INSTRUCTIONS=AVX2 (a slice of
# a larger buffer vs a fresh tensor: same operands, other alignment), 5e-7 of the largest entry.
GEMM_REORDER_ULPS = 8.0


def assert_gemm_close(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor,
                      msg: str = "") -> None:
    """|actual - expected| <= GEMM_REORDER_ULPS * eps32 * magnitude, elementwise, where magnitude is
    the GEMM of the operands' absolute values (|A| @ |B|) that produced `expected`."""
    bound = GEMM_REORDER_ULPS * torch.finfo(torch.float32).eps * magnitude
    excess = (actual.float() - expected.float()).abs() - bound
    assert bool((excess <= 0).all()), f"{msg}: exceeds the reordering bound by {float(excess.max()):.3g}"


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

# KV-cache decoding against the full forward, fp32 logits of a small model (tests/serve): the same
# arithmetic on other batch shapes. The cached path runs the GEMMs on B*P (prefill) or B (decode)
# rows instead of one sequence's S, attention as a masked SDPA over the L cached keys instead of a
# causal one over S, and the MoE experts at decode through the decode path (layers/decode_experts.py)
# instead of grouped_mm; the BLAS rounds each differently (docs/numerics.md), and the differences
# pass through every layer to the logits. Measured worst |error| 6.9e-6 on logits up to 10.3 (ulp
# 9.5e-7: about 7 ulps of the largest logit) over 6 seeds, under the default, AVX2 and AVX512 kernel
# paths. Also used for the same left-padded batch with other padding ids (the padding rows route
# elsewhere, so the real rows fall in other expert groups of the grouped GEMM). atol 3e-5 (~4x that, in logit units: a small logit is a sum of large terms and inherits their
# rounding) plus rtol 1e-5. A wrong mask, position or cache slot moves logits by 1e-2 or more.
KV_DECODE = Tol(1e-5, 3e-5)

# Muon's Newton-Schulz iteration (train/muon.py: Jordan's quintic coefficients (3.4445, -4.7750, 2.0315),
# 5 steps, fp32) does not converge onto the orthogonal factor: it maps every singular value that is not
# tiny against the matrix's Frobenius norm into a band around 1. Measured band [0.682, 1.180] over
# Gaussian matrices 32x64, 64x32, 32x32, 128x32, 5x7, a 32x64 spectrum log-spaced over 1..1e-3, and a
# rank-1 matrix at scale 1e-6 (its one singular value 0.699). The bound, as (low, high) on the singular
# values of each orthogonalised block, leaves ~0.07 either side. Without the iteration (plain Frobenius
# normalisation) the smallest values of a square Gaussian matrix are ~0.01; an orthogonalisation over all
# experts at once leaves an expert 1e3 times quieter than the others at ~1e-3.
NS_SINGULAR_BAND = (0.6, 1.25)
# The same iteration in bf16 (train.muon_ns_dtype=bf16) stays inside that band (measured [0.682, 1.137]
# on the test's experts, fp32 [0.682, 1.134]). Each of its 15 GEMMs (the baddbmm form: the scalings
# inside the GEMMs, each output rounded once) rounds to 8 significant bits (~0.4% relative) and the
# iteration does not undo those roundings, so its factor differs from the fp32 one entrywise by about
# 1e-2 (an entry of a [32, 16] orthogonal factor is ~0.25; measured max 0.013, 0.025 with the scalings
# as separate bf16 ops).
NS_BF16_VS_FP32 = 0.06

# float8_e4m3fn block quantisation (hf/fp8.py, tests/test_hf_deepseek.py): a weight w in a block of
# scale s is stored as e4m3(w / s) and read back as that times s. e4m3 keeps 3 mantissa bits, so
# round-to-nearest is off by at most half an ulp, 2^-4 of the value for normal numbers; below the
# smallest normal (2^-6) the step is 2^-9, half of it 2^-10 in units of s. The fp32 division and
# multiply add a relative 2^-23 each: the +1e-6 slack. Bound: |error| <= E4M3_REL |w| + E4M3_SUBNORMAL s.
E4M3_REL = 2.0**-4 + 1e-6
E4M3_SUBNORMAL = 2.0**-10 + 1e-6

# Sparse upcycling's sanity check (tests/test_hf_upcycle.py): a dense model and the same model
# upcycled to one expert with top-1 (weight exactly 1), trained 15 steps side by side in fp32. The
# functions are equal; the sums are not ordered alike (grouped expert GEMM vs the dense MLP's), so the
# gradients differ by fp32 roundings that AdamW's per-element normalisation amplifies where a
# gradient is near zero. 1e-3 nats per step is the bound (the handbook's check).
UPCYCLE_LOSS_CURVE = 1e-3

# bench train's two models on the same batch (tests/bench/test_bench_train.py): dropless's MoEModel
# and transformers' Qwen3MoeForCausalLM with the same weights compute the same fp32 function with
# sums in other orders (fused qkv GEMM vs three, grouped expert GEMM layouts, SDPA kernels, the
# cross-entropy's reduction), the argument of REFERENCE[fp32], applied to the scalar loss (a mean of
# O(1) terms, no cancellation). Measured: cross-entropy 4.8e-7 apart at 4.16 (1.1e-7 relative, 2 ulps)
# with one layer, 0 with two.
BENCH_TRAIN_LOSS = REFERENCE[torch.float32]

# train.compile against eager training: 5 steps of the tiny run (lr 1e-2) under bf16 autocast
# (tests/train/test_compile_train.py; fp32 runs cannot compile, train/compiling.py), relative difference
# of each step's loss and of the final validation loss. Step 0's forward is the same function; its
# gradients are not bit-equal, because the compiled backward rounds to bf16 at other points (AOTAutograd
# traces autocast's casts into the graph and may decompose an op, inductor fuses element-wise chains and
# keeps their intermediates in fp32), i.e. differences of a bf16 ulp (2^-8) in gradient elements; AdamW
# turns them into lr-sized weight differences where a moment's sign is close, and the later losses
# drift apart. Scale of that drift for a change of kernel path alone: eager with oneDNN capped below
# AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16) against default eager, worst 1.5e-4 (step 3).
# COMPILED_TRAINING (backend aot_eager, the fast test): measured worst 9.6e-4 (step 4); 5e-3 is 5x.
# A fault in the compiled path lands outside: the compile-only SwiGLU backward
# (ops/activations._swiglu_backward_functional) with the up-projection's gradient negated moves the
# losses by 1.4e-2 (step 1) to 3.9e-2 (step 4), the validation loss by 5.5e-2.
COMPILED_TRAINING = 5e-3
# INDUCTOR_TRAINING (backend inductor, the slow test): measured worst 9.3e-3 (step 3: 5.0560 vs 5.1034)
# on torch 2.13, AMX CPU; inductor's fp32 intermediates inside fused kernels change more roundings
# than aot_eager's eager kernels. 3e-2 is 3x; the fault above still moves the validation loss further.
INDUCTOR_TRAINING = 3e-2

# dropless's Muon with bf16 Newton-Schulz against torch.optim.Muon (tests/train/test_muon_torch.py):
# the relative Frobenius error of each orthogonalised matrix, and of each weight's displacement after
# 4 steps. The iteration is the same polynomial with the same constants; the bf16 roundings sit
# elsewhere. torch rounds the gradient to bf16 before its norm and divides in bf16 (dropless normalises
# in fp32 and rounds once), and each step is two fused addmm (one rounding each) where dropless rounds
# 7 times (A A, c A^2, b A, their sum, the product with X, a X, the sum); and dropless adds its
# epsilon (1e-7) to the norm where torch clamps the norm at it, a relative shift of 1e-7 / ||G||, far
# below a bf16 rounding for the test's gradients (norms >= 0.02). Written with torch's two
# placements, dropless's iteration reproduces torch's bit for bit (torch 2.13 CPU); as it is, it lies
# 3.7% from torch's (median), 3.4% from its own fp32 iteration where torch's lies 1.5%. Measured worst
# 4.7% over 360 matrices (30 seeds x 3 experts x the test's 4 shapes, experts scaled 1, 1e3, 1e-3) and
# 2.9% on the displacements (10 seeds, both shape rules). 0.06 is 1.3x the first; a 1% change of one
# coefficient moves the factor by 6-15%, a step more or fewer by 30%, the shape rule without its 0.2
# the displacement by 400%. Tiny matrices (5 x 7) reach 7% from rounding alone and are not tested.
MUON_VS_TORCH_BF16 = 0.06

# A packed window with document masks against each document run alone (tests/test_doc_mask.py), fp32:
# the same arithmetic on other batch shapes, as KV_DECODE: the GEMMs run on B*S rows instead of one
# document's, attention is a masked SDPA over S keys instead of a causal one over the document's,
# and the MoE rows fall in other expert groups; gradients sum the documents' contributions in one
# reduction instead of document by document. Measured worst (torch 2.13 CPU, logits up to ~12,
# gradients up to ~43): logits 5.0e-6, CE / MTP sums 3.1e-5 (sums of ~30 terms of ~3), gradients
# 2.7e-5, i.e. at most 0.68 of this bound (the MLA + MTP + recompute case). A leak across documents
# moves them by units (measured at least 6.1 on the test window; the test asks > 1000 atol = 3e-2).
DOC_MASK = Tol(1e-5, 3e-5)
