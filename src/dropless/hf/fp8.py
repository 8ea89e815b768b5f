"""DeepSeek's FP8 checkpoints: 128x128-block scaled float8_e4m3fn weights, dequantised on import.

Legend: R, C a weight's rows and columns, bR x bC the block (config.json
`quantization_config.weight_block_size`, [128, 128] in DeepSeek-V3), Rb = ceil(R / bR), Cb likewise.

A quantised weight `W` is stored as `W` (float8_e4m3fn, [R, C]) and `W_scale_inv` (fp32, [Rb, Cb]):
the real weight is W[r, c] * scale_inv[r // bR, c // bC], the convention of DeepSeek's own
`weight_dequant` kernel and of transformers' FP8 loader (the last blocks of an odd-sized weight are
partial). The product of an e4m3 value (exact in fp32) and an fp32 scale is one fp32 rounding, so
import is deterministic and the test compares it with a plain per-block loop exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from .defaults import refuse

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)


def block_size(hf: dict[str, Any]) -> tuple[int, int] | None:
    """The weight block of a quantised checkpoint's config.json, or None when it is not quantised;
    a ValueError naming the field for a quantisation this importer does not read."""
    q = hf.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        refuse("quantization_config.quant_method", q.get("quant_method"), "only DeepSeek's block FP8 ('fp8') is read")
    if q.get("fmt", "e4m3") != "e4m3":
        refuse("quantization_config.fmt", q["fmt"], "only e4m3 is read")
    rows, cols = q.get("weight_block_size") or (128, 128)
    return int(rows), int(cols)


def dequantize(w_RC: torch.Tensor, scale_inv_RbCb: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 weight of a block-quantised one (module note); a ValueError when the scale grid does not
    cover the weight."""
    (R, C), (bR, bC) = w_RC.shape, block
    Rb, Cb = -(-R // bR), -(-C // bC)
    if tuple(scale_inv_RbCb.shape) != (Rb, Cb):
        raise ValueError(f"scale of shape {tuple(scale_inv_RbCb.shape)} for a weight of shape {(R, C)} in "
                         f"{bR}x{bC} blocks: expected {(Rb, Cb)}")
    scale_RC = scale_inv_RbCb.float().repeat_interleave(bR, 0)[:R].repeat_interleave(bC, 1)[:, :C]
    return w_RC.float() * scale_RC
