"""Multi-head latent attention (MLA, DeepSeek-V2/V3): low-rank q and kv projections, decoupled rotary.

Legend: B batch, S new tokens, L keys attended (cached + new), D model width, H heads,
Rq query rank, Rkv key/value latent width, Dn the non-rotary ("nope") part of a query/key head,
Dr its rotary part, Dqk = Dn + Dr, Dv value head width, F rotary frequencies (Dr / 2).

    q      = q_b(RMSNorm(q_a(x)))      [B, S, H, Dqk]   (or one q_proj when q_lora_rank = 0)
    c, kr  = kv_a(x)                    [B, S, Rkv], [B, S, Dr]   (kr: one key rope part for all heads)
    k_n, v = kv_b(RMSNorm(c))           [B, S, H, Dn], [B, S, H, Dv]
    q = [q_n | rope(q_r)],  k = [k_n | rope(kr) repeated over heads]
    y = out(softmax(q k^T / sqrt(Dqk)) v)

Only the rotary part carries positions, so the latent c could be cached and re-expanded; this layer
caches the expanded per-head k [.., Dqk] and v [.., Dv] instead (layers/kv_cache.py with a value
width): the simplest correct choice, and the cached tensors are exactly what the full forward
attends over. It spends H (Dqk + Dv) numbers per token where the latent needs Rkv + Dr.

Conventions of transformers' DeepseekV3Attention, which this matches (tests/test_hf_deepseek.py):
- the two latent norms use eps 1e-6 whatever the model's `rms_norm_eps` (transformers builds them
  without it);
- `rope_interleave`: the checkpoint stores each rotary head as interleaved pairs (x0, x1), (x2, x3),
  ... ; transformers rotates them as pairs and writes the result as [evens | odds]. Taking
  [evens | odds] first and then the usual half-split rotary gives the same numbers;
- the softmax scale is 1/sqrt(Dqk), SDPA's default for that width, times YaRN's m(mscale_all_dim)^2
  when the rotary is YaRN-scaled (layers/rotary.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .doc_mask import Mask, attend
from .kv_cache import LayerKVCache
from .norm import RMSNorm
from .rotary import apply_rotary, softmax_mscale

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, used for both latent norms


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...] on the last dim."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """Causal multi-head latent attention; the same call as layers/attention.py Attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, H = cfg.d_model, cfg.n_heads
        self.n_heads, self.head_dim, self.rope_dim, self.v_dim = H, cfg.head_width, cfg.rope_head_dim, cfg.value_width
        self.nope_dim, self.kv_rank, self.interleave = self.head_dim - self.rope_dim, cfg.kv_lora_rank, cfg.rope_interleave
        if cfg.q_lora_rank:
            self.q_a = nn.Linear(D, cfg.q_lora_rank, bias=cfg.attn_bias)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b = nn.Linear(cfg.q_lora_rank, H * self.head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(D, H * self.head_dim, bias=False)
        self.kv_a = nn.Linear(D, self.kv_rank + self.rope_dim, bias=cfg.attn_bias)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b = nn.Linear(self.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.out = nn.Linear(H * self.v_dim, D, bias=cfg.attn_bias)
        mscale = softmax_mscale(cfg.rope_yarn)
        self.scale = None if mscale == 1.0 else mscale / self.head_dim ** 0.5  # None: SDPA's 1/sqrt(Dqk)

    def _query(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x_BSD)
        return self.q_b(self.q_norm(self.q_a(x_BSD)))

    def forward(self, x_BSD: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor,
                kv: LayerKVCache | None = None, mask_B1SL: Mask = None) -> torch.Tensor:
        """As Attention.forward (layers/attention.py): `kv` this layer's cache, `mask_B1SL` bool
        (True = attend) or a flex BlockMask (layers/doc_mask.py)."""
        B, S, _ = x_BSD.shape
        H, Dn, Dr = self.n_heads, self.nope_dim, self.rope_dim
        q_BHSDqk = self._query(x_BSD).view(B, S, H, self.head_dim).transpose(1, 2)
        q_nope, q_rope = q_BHSDqk.split([Dn, Dr], dim=-1)
        c_BSR, k_rope_BSDr = self.kv_a(x_BSD).split([self.kv_rank, Dr], dim=-1)
        kv_BHSW = self.kv_b(self.kv_norm(c_BSR)).view(B, S, H, Dn + self.v_dim).transpose(1, 2)
        k_nope, v_BHSDv = kv_BHSW.split([Dn, self.v_dim], dim=-1)
        k_rope_B1SDr = k_rope_BSDr.unsqueeze(1)
        if self.interleave:
            q_rope, k_rope_B1SDr = deinterleave(q_rope), deinterleave(k_rope_B1SDr)
        q_rope, k_rope_B1SDr = apply_rotary(q_rope, cos_SF, sin_SF), apply_rotary(k_rope_B1SDr, cos_SF, sin_SF)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope_B1SDr.expand(B, H, S, Dr)], dim=-1)
        v = v_BHSDv
        if kv is not None:
            k, v = kv.append(k, v)  # -> B H L Dqk, B H L Dv
        y_BHSDv = attend(q, k, v, mask_B1SL, scale=self.scale)
        return self.out(y_BHSDv.transpose(1, 2).reshape(B, S, H * self.v_dim))
