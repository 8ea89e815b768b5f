"""Rotary positions, shared by the model's attention and the latent attention (layers/mla.py).

Legend: S positions, F rotary frequencies (half the rotated width), Dh the rotated width."""

from __future__ import annotations

import torch


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles_SF = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles_SF.cos(), angles_SF.sin()


def apply_rotary(x_BHSDh: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor) -> torch.Tensor:
    """Tables [S, F] (positions 0..S-1 for every sequence) or [B, 1, S, F] (a position per token)."""
    x1, x2 = x_BHSDh.float().chunk(2, dim=-1)  # rotate pairs (i, i + Dh/2)
    out = torch.cat([x1 * cos_SF - x2 * sin_SF, x1 * sin_SF + x2 * cos_SF], dim=-1)
    return out.to(x_BHSDh.dtype)
