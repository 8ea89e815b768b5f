"""A decoder-only Mixture-of-Experts language model, in one file, for one device.

Legend: B batch, S sequence, D model width, H heads, Dh head width (D / H), V vocabulary.

    tokens_BS -> embedding -> [block] * n_layers -> RMSNorm -> LM head -> logits_BSV
    block(x) = x + attn(norm(x));  x + ffn(norm(x))
    ffn = dense SwiGLU MLP for the first `n_dense_layers` blocks, the MoE layer after them

Attention is causal self-attention with rotary positions through `scaled_dot_product_attention`.
The MoE layers return their aux and z losses; the model adds them to the cross-entropy with their
coefficients from the config, and returns each layer's statistics (device tensors) for the trainer.
Parallelism (expert parallel, FSDP) is applied to this model from outside; nothing here is
distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers.mlp import MLP
from .layers.moe import MoELayer, MoEOutput, MoEStats


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: the mean of squares of bf16 activations loses the small ones.
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles_SF = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles_SF.cos(), angles_SF.sin()


def apply_rotary(x_BHSDh: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHSDh.float().chunk(2, dim=-1)  # rotate pairs (i, i + Dh/2)
    out = torch.cat([x1 * cos_SF - x2 * sin_SF, x1 * sin_SF + x2 * cos_SF], dim=-1)
    return out.to(x_BHSDh.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(B, S, 3, self.n_heads, D // self.n_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # -> B H S Dh
        q, k = apply_rotary(q, cos_SF, sin_SF), apply_rotary(k, cos_SF, sin_SF)
        y_BHSDh = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y_BHSDh.transpose(1, 2).reshape(B, S, D))


@dataclass(frozen=True)
class BlockOutput:
    x: torch.Tensor
    moe: MoEOutput | None = None


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        m = cfg.moe
        self.ffn: nn.Module = (MoELayer(cfg.d_model, m) if moe else
                               MLP(cfg.d_model, cfg.d_ff_dense, m.activation, m.act_clamp, m.act_softcap))

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoELayer)

    def forward(self, x: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor,
                replay_ids: torch.Tensor | None = None, token_ids: torch.Tensor | None = None) -> BlockOutput:
        x = x + self.attn(self.attn_norm(x), cos_SF, sin_SF)
        h = self.ffn_norm(x)
        if not self.is_moe:
            return BlockOutput(x + self.ffn(h))
        out = self.ffn(h, replay_ids, token_ids)
        return BlockOutput(x + out.y, out)


@dataclass(frozen=True)
class ModelOutput:
    logits: torch.Tensor  # B S V
    loss: torch.Tensor | None  # cross-entropy + weighted MoE losses (what to backpropagate)
    ce_loss: torch.Tensor | None  # nats per token
    moe_loss: torch.Tensor  # sum over MoE layers of each balancing loss times its coefficient
    moe: list[MoEOutput]  # per MoE layer: losses without coefficients, statistics

    @property
    def stats(self) -> list[MoEStats]:
        return [m.stats for m in self.moe]


class MoEModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, moe=i >= cfg.n_dense_layers) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=cfg.init_std)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        else:
            nn.init.normal_(self.head.weight, std=cfg.init_std)
        # Residual branches start small so that depth does not blow up the residual stream.
        for block in self.blocks:
            nn.init.normal_(block.attn.out.weight, std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        cos, sin = rotary_tables(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if b.is_moe]

    def forward(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor | None = None,
                replay_ids: list[torch.Tensor] | None = None) -> ModelOutput:
        """`replay_ids`: per MoE layer, expert ids [B, S, K] to use instead of the router's choice."""
        B, S = tokens_BS.shape
        if S > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.embed(tokens_BS)
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        moe: list[MoEOutput] = []
        for block in self.blocks:
            ids = replay_ids[len(moe)] if (replay_ids is not None and block.is_moe) else None
            out = block(x, cos, sin, ids, tokens_BS)
            x = out.x
            if out.moe is not None:
                moe.append(out.moe)
        logits = self.head(self.norm(x))
        moe_loss = self.balancing_loss(moe)
        ce = loss = None
        if targets_BS is not None:
            ce = F.cross_entropy(logits.float().view(B * S, -1), targets_BS.reshape(-1))
            loss = ce + moe_loss
        return ModelOutput(logits, loss, ce, moe_loss, moe)

    def balancing_loss(self, moe: list[MoEOutput]) -> torch.Tensor:
        """Sum over MoE layers of the coefficient-weighted micro-batch and sequence aux losses and the
        z-loss. The global-batch aux loss needs the whole step's counts, so the trainer adds it."""
        bal = self.cfg.moe.balance
        total = torch.zeros((), dtype=torch.float32, device=self.embed.weight.device)
        for m in moe:
            total = total + bal.aux_loss_coeff * m.aux_loss + bal.z_loss_coeff * m.z_loss
            if m.seq_aux_loss is not None:
                total = total + bal.seq_aux_loss_coeff * m.seq_aux_loss
        return total

    def num_params(self) -> dict[str, int]:
        """Total and active (per token) parameter counts; embeddings counted once when tied."""
        total = sum(p.numel() for p in self.parameters())
        active = total
        for layer in self.moe_layers():
            E, K = layer.cfg.num_experts, layer.cfg.top_k
            expert = layer.experts.w_gate_up_EDF.numel() + layer.experts.w_down_EFD.numel()
            active -= expert * (E - K) // E
        return {"total": total, "active": active}
