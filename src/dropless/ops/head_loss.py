"""The LM head's cross-entropy in chunks of tokens: the [N, V] logits never exist whole.

Legend: N tokens (B*S), D model width, V vocabulary, C tokens per chunk.
    x_ND       final hidden states (after the last norm)
    w_VD       the head's weight (tied: the embedding)
    targets_N  ids, IGNORE_INDEX (-100) where no loss is taken

Why. With a large vocabulary the logits dominate a step's memory where the rest of the model is
frozen or small (a LoRA run of Qwen3-30B-A3B's shape: V = 151,936, so 1,024 tokens make 594 MiB of
fp32 logits, and autograd's plain cross-entropy holds the logits, their log-softmax and, in the
backward, their gradient at once). This Function keeps x and the weight (both exist anyway) and,
per chunk of C tokens, forms the logits, their log-sum-exp and the loss sum in the forward; in the
backward it forms them again and writes dx = (softmax - onehot) @ W per chunk, and dW (only when the
head trains) summed over chunks. Peak: one chunk's [C, V] logits and their gradient. Cost: the head
GEMM once more (the recompute), against not keeping 3 x [N, V].

Numerics. Each row's loss is the plain cross-entropy's of the same row (the same GEMM products, the
same log-sum-exp), summed over the chunks in order: the sum differs from one `reduction="sum"` over
all rows by fp32 reordering, and a GEMM over C rows may round a row differently from one over N on
the CPU (MKL's kernel choice depends on the batch): `head_loss_reference` is the same computation
in one piece, compared at the noise floor (tests/ops/test_head_loss.py). The compute dtype is the
autocast dtype when autocast is on (as nn.Linear's would be), else x's; the softmax runs in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # layers/doc_mask.py IGNORE_INDEX (ops sits below layers; a test checks they agree)
CHUNK_TOKENS = 1024


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w_VD, targets_N, chunk, dtype):
        total = torch.zeros((), dtype=torch.float32, device=x_ND.device)
        w = w_VD.to(dtype)
        for s in range(0, x_ND.shape[0], chunk):
            logits_CV = (x_ND[s:s + chunk].to(dtype) @ w.t()).float()
            total = total + F.cross_entropy(logits_CV, targets_N[s:s + chunk], ignore_index=IGNORE,
                                            reduction="sum")
        ctx.save_for_backward(x_ND, w_VD, targets_N)
        ctx.chunk, ctx.dtype = chunk, dtype
        return total

    @staticmethod
    def backward(ctx, g):
        x_ND, w_VD, targets_N = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = w_VD.to(dtype)
        dx = torch.empty_like(x_ND) if need_x else None
        dw = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if need_w else None
        for s in range(0, x_ND.shape[0], chunk):
            x_CD, t_C = x_ND[s:s + chunk].to(dtype), targets_N[s:s + chunk]
            p_CV = torch.softmax((x_CD @ w.t()).float(), dim=-1)  # d(sum CE)/d logits = softmax - onehot
            keep = t_C != IGNORE
            rows = torch.arange(t_C.shape[0], device=t_C.device)
            p_CV[rows, t_C.clamp_min(0)] -= keep.to(p_CV.dtype)
            p_CV *= (keep.to(p_CV.dtype) * g).unsqueeze(-1)
            p = p_CV.to(dtype)
            if need_x:
                dx[s:s + chunk] = (p @ w).to(x_ND.dtype)
            if need_w:  # summed over chunks in fp32 (one product per chunk, then one rounding at the end)
                dw += p_CV.t() @ x_CD.float()
        return dx, None if dw is None else dw.to(w_VD.dtype), None, None, None


def head_loss(x_ND: torch.Tensor, w_VD: torch.Tensor, targets_N: torch.Tensor,
              chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """Sum over the non-ignored tokens of the cross-entropy of x @ w^T (module note), fp32 scalar."""
    return _HeadLoss.apply(x_ND, w_VD, targets_N, chunk, _compute_dtype(x_ND))


def head_loss_reference(x_ND: torch.Tensor, w_VD: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """The same sum in one piece: the plain logits and cross-entropy, autograd keeping both."""
    dtype = _compute_dtype(x_ND)
    logits = (x_ND.to(dtype) @ w_VD.to(dtype).t()).float()
    return F.cross_entropy(logits, targets_N, ignore_index=IGNORE, reduction="sum")
