"""Document masking for packed sequences: several documents in one training window.

Legend: B batch, S sequence, H heads, L keys attended, Dq query/key head width, Dv value head width.

`segments_BS` (int64, non-decreasing along S in each row; equal values = one document) gives:
- positions_BS: each token's rotary position, restarting at 0 at each document's first token;
- the attention mask: causal AND same document, so no token reads an earlier document.
With both, a document's logits are those of the document run alone (positions from 0), up to the
reduction order of the attention's softmax and matmuls (tests/test_doc_mask.py).

Two forms of the mask, `uses_flex` picks one:
- CUDA: a flex attention `BlockMask` (mask_mod = causal & same segment). Its blocks that cross a
  document boundary are skipped by the kernel, so the cost is that of the documents, not of S^2.
  `create_block_mask` evaluates the mask_mod densely once per call (B S^2 bools), shared by every layer.
- elsewhere: a dense bool [B, 1, S, S] (True = attend) for SDPA. Flex attention has no backward on the
  CPU (torch 2.13 refuses inputs that require grad), and its eager CPU forward materialises the scores
  anyway; its forward is used here only to check the BlockMask against the dense mask.

`attend` is the one call the attention modules make: no mask -> causal SDPA (the unpacked training
call, unchanged); a bool tensor -> SDPA with it (document masks and the KV-cache decode masks); a
BlockMask -> flex attention. Flex takes a `scale`, grouped-query heads (`enable_gqa`) and a value width
different from the query/key width, so latent attention (layers/mla.py, Dq = 192, Dv = 128 in
DeepSeek-V3) uses it as well; its Triton kernel needs head widths of at least 16.

Every document's first token attends to itself, so no row of either mask is empty (no NaN softmax).
The segments are not checked for being non-decreasing: that is a device read per call.
"""

from __future__ import annotations

import functools
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

IGNORE_INDEX = -100  # F.cross_entropy's ignore_index
FLEX_MIN_WIDTH = 16  # flex attention's Triton kernel: tl.dot needs head widths >= 16

Mask = Union[torch.Tensor, BlockMask, None]


def positions_of(segments_BS: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: index - index of the first token of the token's segment (device-side, no sync)."""
    S = segments_BS.shape[1]
    idx_S = torch.arange(S, device=segments_BS.device)
    first_B1 = torch.ones_like(segments_BS[:, :1], dtype=torch.bool)
    starts_BS = torch.cat([first_B1, segments_BS[:, 1:] != segments_BS[:, :-1]], dim=1)
    start_BS = torch.where(starts_BS, idx_S, 0).cummax(dim=1).values  # latest segment start so far
    return idx_S - start_BS


def dense_mask(segments_BS: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, S, S], True where query i may attend key j: j <= i and the same segment."""
    S = segments_BS.shape[1]
    causal_SS = torch.ones(S, S, dtype=torch.bool, device=segments_BS.device).tril()
    same_BSS = segments_BS[:, :, None] == segments_BS[:, None, :]
    return (causal_SS & same_BSS).unsqueeze(1)


def block_mask(segments_BS: torch.Tensor) -> BlockMask:
    """The same mask as `dense_mask`, as a flex attention BlockMask (one for all heads)."""
    B, S = segments_BS.shape

    def causal_same_doc(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (segments_BS[b, q] == segments_BS[b, kv])

    return create_block_mask(causal_same_doc, B, None, S, S, device=segments_BS.device)


def uses_flex(device: torch.device, widths: tuple[int, ...]) -> bool:
    """The BlockMask on CUDA when every head width fits flex's kernel; the dense mask otherwise."""
    return device.type == "cuda" and min(widths) >= FLEX_MIN_WIDTH


def doc_mask(segments_BS: torch.Tensor, flex: bool) -> torch.Tensor | BlockMask:
    return block_mask(segments_BS) if flex else dense_mask(segments_BS)


def check_call(tokens_BS: torch.Tensor, segments_BS: torch.Tensor, **others: object) -> None:
    """ValueError for segments of another shape than the tokens, not integers, or given with a KV
    cache, positions or validity (`others`: those arguments; segments define positions and masks)."""
    if segments_BS.shape != tokens_BS.shape:
        raise ValueError(f"segments_BS of shape {tuple(segments_BS.shape)}: must be the tokens' "
                         f"shape {tuple(tokens_BS.shape)}")
    if segments_BS.dtype.is_floating_point or segments_BS.dtype == torch.bool:
        raise ValueError(f"segments_BS of dtype {segments_BS.dtype}: must be an integer tensor (int64)")
    for name, value in others.items():
        if value is not None:
            raise ValueError(f"segments_BS with {name}: document masking is for the training/eval call "
                             "only (it sets the positions and the mask itself)")


def mask_tensors(mask: Mask) -> list[torch.Tensor]:
    """The tensors a mask holds (an offload scope keeps them in place: one mask serves every layer)."""
    if mask is None:
        return []
    if isinstance(mask, torch.Tensor):
        return [mask]
    return [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    # eager flex attention materialises the scores; compiled, it is the fused block-sparse kernel
    return torch.compile(flex_attention, dynamic=False)


def attend(q_BHSDq: torch.Tensor, k_BHLDq: torch.Tensor, v_BHLDv: torch.Tensor, mask: Mask,
           scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Attention output [B, H, S, Dv] under `mask` (module note); `scale` None: 1 / sqrt(Dq)."""
    if mask is None:
        return F.scaled_dot_product_attention(q_BHSDq, k_BHLDq, v_BHLDv, is_causal=True, scale=scale,
                                              enable_gqa=enable_gqa)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q_BHSDq, k_BHLDq, v_BHLDv, attn_mask=mask, scale=scale,
                                              enable_gqa=enable_gqa)
    fused = q_BHSDq.is_cuda and not torch.compiler.is_compiling()  # inside a compiled model: traced
    flex = _compiled_flex() if fused else flex_attention
    return flex(q_BHSDq, k_BHLDq, v_BHLDv, block_mask=mask, scale=scale, enable_gqa=enable_gqa)


def packed_cross_entropy(logits_TV: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the non-ignored targets, 0 (not NaN) when none is left: the sum over
    them divided by max(count, 1), on the device (no host read of the count)."""
    total = F.cross_entropy(logits_TV, targets_T, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (targets_T != IGNORE_INDEX).sum().clamp_min(1)
