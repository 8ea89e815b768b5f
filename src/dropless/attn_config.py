"""The attention part of the model config (`model.attention` and its MLA fields, `model.rope_yarn`):
validation kept apart from config.py, which re-exports these names. Same design as config.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .configtree import _choice, _fail, _positive

ATTENTIONS = ("standard", "mla")


@dataclass
class YarnConfig:
    """YaRN rotary scaling (layers/rotary.py), as transformers' `rope_type: yarn` parameters; factor 1 = off."""

    factor: float = 1.0  # context extension factor
    original_max_seq_len: int = 0  # positions the model was pretrained on
    beta_fast: float = 32.0  # rotations at which the ramp from interpolation to extrapolation ends ...
    beta_slow: float = 1.0  # ... and starts
    mscale: float = 0.0  # with mscale_all_dim: the cos/sin scale is m(mscale) / m(mscale_all_dim)
    mscale_all_dim: float = 0.0  # (0: m(1)); MLA also multiplies its softmax scale by m(mscale_all_dim)^2

    def validate(self, prefix: str) -> None:
        if not self.factor >= 1.0:
            _fail(f"{prefix}.factor", self.factor, "must be >= 1 (1 = no scaling)")
        if self.factor > 1.0:
            _positive(f"{prefix}.original_max_seq_len", self.original_max_seq_len)
        for name in ("beta_fast", "beta_slow"):
            if not getattr(self, name) > 0:
                _fail(f"{prefix}.{name}", getattr(self, name), "must be > 0")
        for name in ("mscale", "mscale_all_dim"):
            if not getattr(self, name) >= 0:
                _fail(f"{prefix}.{name}", getattr(self, name), "must be >= 0")


def check_attention(cfg: Any) -> None:
    """The attention fields of a ModelConfig `cfg`: MLA's only with `attention="mla"`, and consistent."""
    _choice("model.attention", cfg.attention, ATTENTIONS)
    mla = ("q_lora_rank", "kv_lora_rank", "rope_head_dim", "v_head_dim")
    for name in mla:
        if isinstance(getattr(cfg, name), bool) or not getattr(cfg, name) >= 0:
            _fail(f"model.{name}", getattr(cfg, name), "must be >= 0")
    if cfg.attention == "standard":
        for name in (*mla, "rope_interleave"):
            if getattr(cfg, name):
                _fail(f"model.{name}", getattr(cfg, name), "is a field of model.attention='mla'")
    else:
        _positive("model.kv_lora_rank", cfg.kv_lora_rank)
        if not 0 < cfg.rope_head_dim < cfg.head_width:
            _fail("model.rope_head_dim", cfg.rope_head_dim, f"must be in (0, head width {cfg.head_width})")
        if cfg.kv_heads != cfg.n_heads:
            _fail("model.n_kv_heads", cfg.n_kv_heads, "model.attention='mla' has one key/value head per query head")
        if cfg.qk_norm:
            _fail("model.qk_norm", cfg.qk_norm, "model.attention='mla' normalises its latents instead")
        if "attn_input" in cfg.offload:
            _fail("model.offload", cfg.offload, "'attn_input' hooks the fused qkv projection; "
                  "model.attention='mla' has none (offload 'attn')")
    if cfg.rope_width % 2:
        name = "rope_head_dim" if cfg.attention == "mla" else "head_dim" if cfg.head_dim else "n_heads"
        _fail(f"model.{name}", getattr(cfg, name), f"rotary width {cfg.rope_width} must be even")
