"""Rotary positions, shared by the model's attention and the latent attention (layers/mla.py).

Legend: S positions, F rotary frequencies (half the rotated width), Dh the rotated width.

YaRN (`ModelConfig.rope_yarn`, factor > 1), transformers' `_compute_yarn_parameters` step by step:
each frequency is blended between its plain value (extrapolation: fast frequencies, more than
beta_fast rotations over the original context) and its value divided by `factor` (interpolation:
slow ones, fewer than beta_slow rotations), linearly in between over the frequency index (the
correction range floored / ceiled: transformers' `truncate`); the cos/sin tables are multiplied by
the attention factor m(mscale) / m(mscale_all_dim) (or m(1) without them),
m(s) = 0.1 s ln(factor) + 1. DeepSeek's latent attention also multiplies its softmax scale by
m(mscale_all_dim)^2 (`softmax_mscale`).
"""

from __future__ import annotations

import math

import torch

from ..attn_config import YarnConfig


def _m(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_mscale(yarn: YarnConfig) -> float:
    """The factor DeepSeek's MLA multiplies its softmax scale by under YaRN (1 without it)."""
    return _m(yarn.factor, yarn.mscale_all_dim) ** 2 if yarn.factor > 1 and yarn.mscale_all_dim else 1.0


def rotary_tables(seq_len: int, head_dim: int, theta: float, yarn: YarnConfig | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    scale = 1.0
    if yarn is not None and yarn.factor > 1:
        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
        high = min(math.ceil(correction_dim(yarn.beta_slow)), head_dim - 1)
        ramp_F = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
        extrapolate_F = 1 - ramp_F
        pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolate_F) + (1.0 / pos_freqs) * extrapolate_F
        scale = (_m(yarn.factor, yarn.mscale) / _m(yarn.factor, yarn.mscale_all_dim)
                 if yarn.mscale and yarn.mscale_all_dim else _m(yarn.factor))
    angles_SF = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    if scale == 1.0:
        return angles_SF.cos(), angles_SF.sin()
    return angles_SF.cos() * scale, angles_SF.sin() * scale


def apply_rotary(x_BHSDh: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor) -> torch.Tensor:
    """Tables [S, F] (positions 0..S-1 for every sequence) or [B, 1, S, F] (a position per token)."""
    x1, x2 = x_BHSDh.float().chunk(2, dim=-1)  # rotate pairs (i, i + Dh/2)
    out = torch.cat([x1 * cos_SF - x2 * sin_SF, x1 * sin_SF + x2 * cos_SF], dim=-1)
    return out.to(x_BHSDh.dtype)


def rotary_at(table_PF: torch.Tensor, start: int, S: int, positions_BS: torch.Tensor | None) -> torch.Tensor:
    """A cos or sin table for S tokens: rows start..start+S-1 [S, F], or each token's [B, 1, S, F]."""
    if positions_BS is None:
        return table_PF[start:start + S]
    return table_PF[positions_BS].unsqueeze(1)
