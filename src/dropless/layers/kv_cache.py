"""Key/value caches for incremental decoding: prefill once, then one token per step.

Legend: B batch, H key/value heads, S new tokens of a call, L cached + new tokens, C capacity (the
longest sequence the cache holds), Dh head width.

One `LayerKVCache` per attention layer holds preallocated [B, H, C, Dh] key and value buffers; a call
writes its S new keys/values in place at [length, length + S) and attends over the first L. Buffers
are allocated on the first write, with the dtype and device of the keys (fp32, or bf16 under
autocast), so the cache needs no knowledge of the model's dtype. The per-layer object is the seam for
other attention variants: a grouped-query layer stores fewer heads H (its queries repeat them); a
latent (MLA, layers/mla.py) layer stores its expanded per-head keys and values, whose widths differ
(`v_dim`), not the compressed latent (the simplest correct choice: more bytes, no re-expansion); the
model asks nothing else of it.

`KVCache` holds the layers and what they share: the number of positions written (`length`) and which
of them are real tokens (`valid_BC`), from which it builds the attention mask of each call. Batches
of prompts of different lengths are left-padded: every sequence ends at the same column, so a decode
step writes column `length` for all of them. A padding key is masked out of every real query; a
padding query attends to itself only, so that no row of the mask is entirely False (softmax over
nothing: torch 2.13's CPU kernels define it as a zero row, measured, but older versions and other
backends gave NaN, which a padding row would then carry into the MoE router). Padding rows still go
through the MoE layers: token-choice routing is per token, so they change no real token's result.
Routing that depends on the other tokens of a call (expert choice; a capacity-limited layer, which
drops by position or score among the call's pairs) would route a one-token decode step otherwise
than the full forward, and a prompt otherwise beside others: serve/generate.py refuses the cache for
those models (the recompute path runs each sequence alone).
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """Preallocated keys and values of one attention layer (H = the key/value heads: the query heads
    for multi-head attention, fewer for grouped-query)."""

    def __init__(self, batch: int, n_heads: int, capacity: int, head_dim: int, v_dim: int | None = None) -> None:
        self.shape = (batch, n_heads, capacity, head_dim)
        self.v_shape = (batch, n_heads, capacity, v_dim or head_dim)
        self.k_BHCDh: torch.Tensor | None = None
        self.v_BHCDh: torch.Tensor | None = None
        self.length = 0

    def append(self, k_BHSDh: torch.Tensor, v_BHSDh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the S new keys/values after the cached ones; return views of all L = length + S."""
        S = k_BHSDh.shape[2]
        if self.k_BHCDh is None:
            self.k_BHCDh = k_BHSDh.new_empty(self.shape)
            self.v_BHCDh = v_BHSDh.new_empty(self.v_shape)
        if k_BHSDh.shape[:2] != self.shape[:2] or self.length + S > self.shape[2]:
            raise ValueError(f"KV cache of shape {self.shape} holding {self.length}: cannot append keys "
                             f"of shape {tuple(k_BHSDh.shape)}")
        end = self.length + S
        self.k_BHCDh[:, :, self.length:end] = k_BHSDh
        self.v_BHCDh[:, :, self.length:end] = v_BHSDh
        self.length = end
        return self.k_BHCDh[:, :, :end], self.v_BHCDh[:, :, :end]


class KVCache:
    """The caches of every layer of a model, and the token validity they share."""

    def __init__(self, n_layers: int, batch: int, capacity: int, n_heads: int, head_dim: int,
                 device: torch.device | str, v_dim: int | None = None) -> None:
        self.layers = [LayerKVCache(batch, n_heads, capacity, head_dim, v_dim) for _ in range(n_layers)]
        self.valid_BC = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.capacity = capacity
        self.length = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch: int, capacity: int) -> "KVCache":
        cfg = model.cfg
        return cls(cfg.n_layers, batch, capacity, cfg.kv_heads, cfg.head_width, model.embed.weight.device,
                   cfg.value_width)

    def begin(self, S: int, valid_BS: torch.Tensor | None) -> torch.Tensor:
        """Record the validity of the S tokens of the next call (None: all real) and return its
        attention mask, bool [B, 1, S, L] (True = attend). The layers then append their keys."""
        start, end = self.length, self.length + S
        if end > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity}: cannot take {S} more tokens after {start}")
        if valid_BS is None:
            self.valid_BC[:, start:end] = True
        else:
            self.valid_BC[:, start:end] = valid_BS
        q_S1 = torch.arange(start, end, device=self.valid_BC.device).unsqueeze(1)
        k_1L = torch.arange(end, device=self.valid_BC.device).unsqueeze(0)
        mask_BSL = (k_1L <= q_S1) & self.valid_BC[:, None, :end]
        mask_BSL = mask_BSL | (k_1L == q_S1)  # a padding query sees itself (module docstring)
        self.length = end
        return mask_BSL.unsqueeze(1)

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (the buffers keep their bytes, overwritten later):
        rewinds a step, e.g. to time the same decode step again."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate({length}): the cache holds {self.length} positions")
        self.length = length
        for layer in self.layers:
            layer.length = length


def padding_mask(valid_BS: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, S, S] of a call without a cache: causal, padding keys masked out, and a padding
    query sees itself only (module note)."""
    S = valid_BS.shape[1]
    causal_SS = torch.ones(S, S, dtype=torch.bool, device=valid_BS.device).tril()
    mask_BSS = (causal_SS & valid_BS[:, None, :]) | torch.eye(S, dtype=torch.bool, device=valid_BS.device)
    return mask_BSS.unsqueeze(1)
