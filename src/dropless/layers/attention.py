"""Causal self-attention, multi-head or grouped-query, as the model's blocks use it (model.py;
DeepSeek's latent attention, which takes the same call, is layers/mla.py).

Legend: B batch, S sequence, D model width, H query heads, Hkv key/value heads, N = H + 2 Hkv,
Dh head width, F rotary frequencies (Dh / 2), L keys attended (cached + new).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .doc_mask import Mask, attend
from .kv_cache import LayerKVCache
from .norm import RMSNorm
from .rotary import apply_rotary


class Attention(nn.Module):
    """Causal self-attention: multi-head, or grouped-query with `n_kv_heads` < `n_heads` (query head h
    reads key/value head h // (Hq / Hkv), as in Llama-style checkpoints), with optional per-head q/k
    RMSNorm (Qwen3: over each head's Dh, before the rotary) and projection biases.

    One fused input projection: its rows are q (Hq heads), then k (Hkv), then v (Hkv), each head's
    Dh rows together; with Hkv = Hq and Dh = D / Hq that is the original [3D, D] layout, unchanged."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_width
        width = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv = nn.Linear(cfg.d_model, width, bias=cfg.attn_bias)
        self.out = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=cfg.attn_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def _split(self, qkv_BSND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, S, Hq + 2 Hkv, Dh] -> q, k, v as [B, H, S, Dh], q and k normalised when qk_norm."""
        q, k, v = qkv_BSND.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x_BSD: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor,
                kv: LayerKVCache | None = None, mask_B1SL: Mask = None) -> torch.Tensor:
        """`kv`: this layer's cache (the new keys are appended, all cached ones attended);
        `mask_B1SL`: bool, True = attend, or a flex BlockMask (replaces the plain causal mask;
        layers/doc_mask.py)."""
        B, S, _ = x_BSD.shape
        H, Hkv = self.n_heads, self.n_kv_heads
        qkv_BSND = self.qkv(x_BSD).view(B, S, H + 2 * Hkv, self.head_dim)
        if kv is None:
            q, k, v = self._split(qkv_BSND)
            q, k = apply_rotary(q, cos_SF, sin_SF), apply_rotary(k, cos_SF, sin_SF)
        else:
            if self.q_norm is None:
                # decoding: q and k rotated in one call (elementwise: the same numbers as two calls),
                # fewer small ops in a step that is mostly per-op overhead
                qkv_BNSDh = qkv_BSND.transpose(1, 2)
                qk, v = apply_rotary(qkv_BNSDh[:, :H + Hkv], cos_SF, sin_SF), qkv_BNSDh[:, H + Hkv:]
            else:
                q, k, v = self._split(qkv_BSND)
                qk = apply_rotary(torch.cat([q, k], dim=1), cos_SF, sin_SF)
            q, k = qk[:, :H], qk[:, H:]
            k, v = kv.append(k, v)  # -> B Hkv L Dh
        # grouped-query: each key/value head repeated for its H / Hkv query heads
        y_BHSDh = attend(q, k, v, mask_B1SL, enable_gqa=Hkv < H)
        return self.out(y_BHSDh.transpose(1, 2).reshape(B, S, H * self.head_dim))
