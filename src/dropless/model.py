"""A decoder-only Mixture-of-Experts language model, in one file, for one device.

Legend: B batch, S sequence, D model width, H query heads, Hkv key/value heads, N = H + 2 Hkv,
Dh head width (D / H unless `head_dim` says otherwise), V vocabulary, F rotary frequencies (Dh / 2),
L keys attended (cached + new).

    tokens_BS -> embedding -> [block] * n_layers -> RMSNorm -> LM head -> logits_BSV
    block(x) = x + attn(norm(x));  x + ffn(norm(x))
    parallel MoE block (model.block = "parallel_moe"): x + attn(norm(x)) + moe(norm'(x))
    ffn = dense SwiGLU MLP for the first `n_dense_layers` blocks, the MoE layer after them (every
          `moe_layer_freq`-th one, or the listed ones: model_knobs.py)
    training with `mtp_depth` > 0 adds the multi-token prediction modules' loss (layers/mtp.py;
    their blocks dense, or MoE with `mtp_block = "moe"`)

Attention is causal self-attention with rotary positions through `scaled_dot_product_attention`;
grouped-query heads, q/k RMSNorm and biases are config switches (the Qwen3-MoE and Mixtral layouts,
docs/models.md), all off by default; `attention = "mla"` swaps in DeepSeek's latent attention
(layers/mla.py), which takes the same arguments.
The MoE layers return their aux and z losses; the model adds them to the cross-entropy with their
coefficients from the config, and returns each layer's statistics (device tensors) for the trainer.
Incremental decoding (serve/generate.py) passes a `KVCache` (layers/kv_cache.py), each token's
position for the rotary tables, and which tokens are padding; the training call passes none of them
and runs exactly the code it ran before (causal SDPA over [S, F] tables). A packed window passes
`segments_BS`: attention within each document, positions from 0 in each (layers/doc_mask.py).
Activation recompute (`cfg.recompute`, layers/recompute.py) wraps parts of a block in a checkpoint;
a recomputed MoE layer replays the expert ids its forward chose, so it never re-routes.
Activation offload (`cfg.offload`, layers/offload.py) runs parts of a block inside saved-tensor
hooks that move what autograd saves to host memory; the model owns the one `Offloader` (its counter).
Low-rank adapters (`lora=`, model_lora.py): adapters on the chosen projections and experts, the
rest frozen; with `loss_only` (a LoRA run's training call) the loss comes from the final hidden
states in chunks (ops/head_loss.py) and no [B, S, V] logits are made.
Parallelism (expert parallel, FSDP) is applied to this model from outside; nothing here is
distributed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import model_lora
from .config import LoRAConfig, ModelConfig
from .expert_slots import ExpertSlots
from .layers import doc_mask, init, offload, recompute
from .layers.attention import Attention
from .layers.kv_cache import KVCache, LayerKVCache, padding_mask
from .layers.mla import LatentAttention
from .layers.mlp import MLP
from .layers.moe import MoELayer, MoEOutput, MoEStats
from .layers.mtp import MTPModule, mtp_loss
from .layers.norm import RMSNorm
from .layers.rotary import apply_rotary, rotary_at, rotary_tables
from .ops.head_loss import head_loss

__all__ = ["Attention", "Block", "MoEModel", "ModelOutput", "RMSNorm", "apply_rotary", "rotary_tables"]

Out = TypeVar("Out")


@dataclass(frozen=True)
class BlockOutput:
    x: torch.Tensor
    moe: MoEOutput | None = None


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool, offloader: offload.Offloader | None = None,
                 lora: LoRAConfig | None = None, index: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = LatentAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        m = cfg.moe
        self.ffn: nn.Module = (MoELayer(cfg.d_model, m) if moe else
                               MLP(cfg.d_model, cfg.d_ff_dense, m.activation, m.act_clamp, m.act_softcap))
        model_lora.adapt_block(self.attn, self.ffn, index, lora)  # train.lora (before the offload hooks)
        self.recompute = recompute.modes_of(cfg.recompute)  # layers/recompute.py
        if moe:  # inside the MoE layer: it checkpoints its shared experts itself
            self.ffn.recompute_shared = "shared_experts" in self.recompute
        self.offload = frozenset(cfg.offload)  # layers/offload.py; disjoint from the recompute scopes
        self.offloader = offloader or (offload.Offloader() if cfg.offload else None)
        if "attn_input" in self.offload:  # scopes inside another module's forward: forward hooks
            offload.attach(self.attn.qkv, self.offloader)
        if "experts" in self.offload and moe:
            offload.attach(self.ffn.experts, self.offloader)
        # model.block "parallel_moe" (ScMoE shortcut, model_knobs.py): the MoE reads the block input
        self.parallel = moe and cfg.block == "parallel_moe"

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoELayer)

    def forward(self, x: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor,
                replay_ids: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                kv: LayerKVCache | None = None, mask_B1SL: doc_mask.Mask = None) -> BlockOutput:
        modes = self.recompute if recompute.active(kv) else frozenset()
        if "layer" in self.offload and recompute.active(kv):
            with self._offload_scope(cos_SF, sin_SF, mask_B1SL):
                return self._forward(x, cos_SF, sin_SF, replay_ids, token_ids, kv, mask_B1SL, modes)
        if "layer" in modes:  # the whole block, with the forward's expert ids in the recompute
            return recompute.recomputed_routed(
                lambda ids: self._forward(x, cos_SF, sin_SF, ids, token_ids, kv, mask_B1SL, modes),
                replay_ids, lambda out: out.moe.ids_TK if out.moe is not None else None)
        return self._forward(x, cos_SF, sin_SF, replay_ids, token_ids, kv, mask_B1SL, modes)

    def _offload_scope(self, cos_SF: torch.Tensor, sin_SF: torch.Tensor,
                       mask: doc_mask.Mask) -> offload.OffloadScope:
        # parameters, the rotary tables and the mask serve every layer: left in place (saved by reference)
        return self.offloader.scope([*self.parameters(), cos_SF, sin_SF, *doc_mask.mask_tensors(mask)])

    def _forward(self, x: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor,
                 replay_ids: torch.Tensor | None, token_ids: torch.Tensor | None, kv: LayerKVCache | None,
                 mask_B1SL: doc_mask.Mask, modes: frozenset[str]) -> BlockOutput:
        def part(mode: str, fn: Callable[..., Out], *args: object) -> Out:
            # fn(*args), its activations recomputed in the backward or offloaded when `mode` is listed
            if mode in modes:
                return recompute.recomputed(fn, *args)
            if mode in self.offload and recompute.active(kv):
                with self._offload_scope(cos_SF, sin_SF, mask_B1SL):
                    return fn(*args)
            return fn(*args)

        def moe(h: torch.Tensor) -> MoEOutput:
            if "moe" in modes:
                return recompute.recomputed_routed(lambda ids: self.ffn(h, ids, token_ids), replay_ids,
                                                   lambda o: o.ids_TK)
            return part("moe", self.ffn, h, replay_ids, token_ids)

        if self.parallel:
            # The MoE depends on x only, not on attention's output: this is where its dispatch
            # would overlap attention on a device with streams (issue the router, the permutation
            # and the expert-parallel all-to-all on a side stream here, run attention on the main
            # stream, wait for the side stream before the sum). On one stream, and on the CPU, the
            # two simply run in this order; the sum below is the same either way.
            out = moe(part("norm", self.ffn_norm, x))
            h = part("norm", self.attn_norm, x)
            return BlockOutput(x + part("attn", self.attn, h, cos_SF, sin_SF, kv, mask_B1SL) + out.y, out)
        h = part("norm", self.attn_norm, x)
        x = x + part("attn", self.attn, h, cos_SF, sin_SF, kv, mask_B1SL)
        h = part("norm", self.ffn_norm, x)
        if not self.is_moe:
            return BlockOutput(x + self.ffn(h))
        out = moe(h)
        return BlockOutput(x + out.y, out)


@dataclass(frozen=True)
class ModelOutput:
    logits: torch.Tensor | None  # B S V; None from a `loss_only` call
    loss: torch.Tensor | None  # cross-entropy + weighted MoE losses (what to backpropagate)
    ce_loss: torch.Tensor | None  # nats per token
    moe_loss: torch.Tensor  # sum over MoE layers of each balancing loss times its coefficient
    moe: list[MoEOutput]  # per MoE layer: losses without coefficients, statistics
    # multi-token prediction (layers/mtp.py): mean over the modules of their cross-entropy, without
    # model.mtp_weight (`loss` includes it times the weight); None unless training with mtp_depth > 0
    mtp_loss: torch.Tensor | None = None
    # model.mtp_block "moe": each MTP module's MoE output (training only); `moe_loss` and `loss`
    # include their balancing losses, `moe` and `stats` stay the main model's layers
    mtp_moe: list[MoEOutput] = field(default_factory=list)

    @property
    def stats(self) -> list[MoEStats]:
        return [m.stats for m in self.moe]

    @property
    def all_stats(self) -> list[MoEStats]:
        """The main MoE layers' statistics, then the MTP modules' (MoEModel.all_moe_layers order)."""
        return [m.stats for m in [*self.moe, *self.mtp_moe]]


def balancing_loss(cfg: ModelConfig, moe: list[MoEOutput], device: torch.device) -> torch.Tensor:
    """Sum over MoE layers of the coefficient-weighted micro-batch and sequence aux losses and the
    z-loss. The global-batch aux loss needs the whole step's counts, so the trainer adds it (a
    pipeline stage, distributed/pipeline.py, calls this on its own layers)."""
    bal = cfg.moe.balance
    total = torch.zeros((), dtype=torch.float32, device=device)
    for m in moe:
        total = total + bal.aux_loss_coeff * m.aux_loss + bal.z_loss_coeff * m.z_loss
        if m.seq_aux_loss is not None:
            total = total + bal.seq_aux_loss_coeff * m.seq_aux_loss
    return total


def _rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_tables(cfg.max_seq_len, cfg.rope_width, cfg.rope_theta, cfg.rope_yarn)


class MoEModel(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int | None = None, lora: LoRAConfig | None = None) -> None:
        """Initial weights: a function of `seed` and each parameter's name (layers/init.py), the
        same whatever device or sharding later holds them; without `seed`, one drawn from the global
        generator (so `torch.manual_seed` still decides them). Built on the meta device (under
        `torch.device("meta")`) nothing is drawn: `materialize` then `init_weights` (or a load).
        `lora` (train.lora): adapters on the blocks it names, every other parameter frozen
        (model_lora.py); the MTP modules are never adapted."""
        super().__init__()
        self.cfg = cfg
        # what activation offload moved (layers/offload.py): `offloader.counter`; None without offload
        self.offloader = offload.Offloader() if cfg.offload else None
        target = torch.get_default_device()
        # under a tensor mode (the planner's fake tensors) the modules are built in it, as drawn
        traced = _get_current_dispatch_mode() is not None
        with contextlib.nullcontext() if traced else torch.device("meta"):  # values: init_weights
            # (given its weight: nn.Embedding's own init would draw on meta, which imports torch._dynamo)
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=torch.empty(cfg.vocab_size, cfg.d_model))
            moe_ids = set(cfg.moe_layer_ids)  # model.n_dense_layers, model.moe_layer_freq (model_knobs.py)
            self.blocks = nn.ModuleList(Block(cfg, moe=i in moe_ids, offloader=self.offloader, lora=lora, index=i)
                                        for i in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            # multi-token prediction (layers/mtp.py): dense or MoE blocks (model.mtp_block), the
            # embedding and head shared
            self.mtp = nn.ModuleList(
                MTPModule(cfg.d_model, Block(cfg, moe=cfg.mtp_block == "moe", offloader=self.offloader),
                          lambda: RMSNorm(cfg.d_model, cfg.norm_eps)) for _ in range(cfg.mtp_depth))
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.lora = lora if lora is not None and lora.enabled else None
        model_lora.freeze(self, self.lora)
        cos, sin = _rope_tables(cfg)
        self.register_buffer("rope_cos", cos.to(target), persistent=False)
        self.register_buffer("rope_sin", sin.to(target), persistent=False)
        if target.type != "meta" and not traced:
            self.materialize(target)
            self.init_weights(int(torch.randint(0, 2**62, ()).item()) if seed is None else seed)

    def init_rules(self) -> dict[str, init.Rule]:
        """The model's own rules over its modules' (layers/init.py): embeddings and head N(0, init_std);
        the attention output projections N(0, init_std / sqrt(2 n_layers)), so that residual
        branches start small and depth does not blow up the residual stream."""
        std = self.cfg.init_std
        rules = {"embed.weight": init.normal(std), "head.weight": init.normal(std)}
        for name, module in self.named_modules():
            if isinstance(module, Block):
                rules[f"{name}.attn.out.weight"] = init.normal(std / (2 * self.cfg.n_layers) ** 0.5)
        return rules

    def init_weights(self, seed: int, where: init.Where = init.whole,
                     only: Callable[[str], bool] | None = None) -> None:
        """Every parameter's initial values from (seed, its name), or those `only` accepts: each
        process fills the rows `where` says it holds (layers/init.py; one process: all of them)."""
        init.init_parameters(self, seed, where, only)

    def materialize(self, device: torch.device | str) -> "MoEModel":
        """A model built on the meta device, on `device`: parameters and persistent buffers allocated
        but not initialised (for load_state_dict to fill), the tied head tied again (`to_empty` gives
        each module a tensor of its own) and the rotary tables (computed, never stored) computed."""
        self.to_empty(device=device)
        if self.cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = _rope_tables(self.cfg)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        for module in self.modules():  # buffers with an initial value (the routers')
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()
        return self

    def moe_layers(self) -> list[MoELayer]:
        """The main model's MoE layers (the trainer's per-layer statistics, routing replay and
        records, serving); the MTP modules' MoE blocks are `mtp_moe_layers()`."""
        return [b.ffn for b in self.blocks if b.is_moe]

    def mtp_moe_layers(self) -> list[MoELayer]:
        """The MoE layers of the MTP modules' blocks (model.mtp_block "moe"; else none)."""
        return [m.block.ffn for m in self.mtp if m.block.is_moe]

    def all_moe_layers(self) -> list[MoELayer]:
        """Every MoE layer a training step runs: the main ones, then the MTP modules' (what the
        balancing rules, the EP buffers and the overflow guard cover)."""
        return [*self.moe_layers(), *self.mtp_moe_layers()]

    def expert_slots(self) -> ExpertSlots:
        """The MoE layers' expert slots (expert_slots.py; every layer has the same). A model without
        MoE layers routes nothing: the config's."""
        layers = self.moe_layers()
        return layers[0].slots if layers else ExpertSlots.from_config(self.cfg.moe)

    def forward(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor | None = None,
                replay_ids: list[torch.Tensor] | None = None, *, positions_BS: torch.Tensor | None = None,
                cache: KVCache | None = None, valid_BS: torch.Tensor | None = None,
                segments_BS: torch.Tensor | None = None, loss_only: bool = False) -> ModelOutput:
        """`replay_ids`: per MoE layer, expert ids [B, S, K] to use instead of the router's choice.

        Incremental decoding (all optional; the training call passes none):
        - `cache`: keys/values of the earlier positions; this call's are appended (its `length`
          advances by S) and the tokens attend to all cached ones they may see.
        - `positions_BS`: each token's rotary position (int64; left padding: a prompt's first real
          token is position 0). Default: 0..S-1, or the cache's length onwards. Not checked against
          max_seq_len on the device (a host read): callers check (serve/generate.py does).
        - `valid_BS`: bool, False at padding tokens, which real tokens then never attend to.

        `segments_BS` (packed documents, not with the above): int64 [B, S], non-decreasing along S, equal
        values = one document; targets stay the caller's, the cross-entropy is 0 (not NaN) with none left.

        `loss_only` (with targets; a LoRA run's trainer passes it): the cross-entropy from the final
        hidden states in chunks of tokens (ops/head_loss.py), so the [B, S, V] logits never exist
        whole; `logits` is then None, the losses are the same up to fp32 reordering."""
        B, S = tokens_BS.shape
        if segments_BS is not None:  # layers/doc_mask.py
            doc_mask.check_call(tokens_BS, segments_BS, cache=cache, positions_BS=positions_BS, valid_BS=valid_BS)
        start = cache.length if cache is not None else 0
        if start + S > self.cfg.max_seq_len and positions_BS is None:
            raise ValueError(f"sequence length {start + S} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.embed(tokens_BS)
        flex = doc_mask.uses_flex(x.device, (self.cfg.head_width, self.cfg.value_width))
        pos = positions_BS if segments_BS is None else doc_mask.positions_of(segments_BS)
        cos, sin = rotary_at(self.rope_cos, start, S, pos), rotary_at(self.rope_sin, start, S, pos)
        mask: doc_mask.Mask = None if segments_BS is None else doc_mask.doc_mask(segments_BS, flex)
        if cache is not None:
            mask = cache.begin(S, valid_BS)
        elif valid_BS is not None:
            mask = padding_mask(valid_BS)
        moe: list[MoEOutput] = []
        for i, block in enumerate(self.blocks):
            ids = replay_ids[len(moe)] if (replay_ids is not None and block.is_moe) else None
            kv = cache.layers[i] if cache is not None else None
            out = block(x, cos, sin, ids, tokens_BS, kv, mask)
            x = out.x
            if out.moe is not None:
                moe.append(out.moe)
        moe_loss = self.balancing_loss(moe)
        ce = loss = mtp = logits = None
        mtp_moe: list[MoEOutput] = []
        if loss_only and targets_BS is not None:  # the trainer's call (ops/head_loss.py): no [B, S, V]
            t = targets_BS.reshape(-1)
            total = head_loss(self.norm(x).view(B * S, -1), self.head.weight, t)
            ce = total / (t != doc_mask.IGNORE_INDEX).sum().clamp_min(1)
        else:
            logits = self.head(self.norm(x))
        if targets_BS is not None:
            if ce is None:
                ce_of = F.cross_entropy if segments_BS is None else doc_mask.packed_cross_entropy  # 0, not NaN
                ce = ce_of(logits.float().view(B * S, -1), targets_BS.reshape(-1))
            loss = ce + moe_loss
            # the training call only: evaluation reports the main loss alone, generation never runs MTP
            if len(self.mtp) and self.training and cache is None and positions_BS is None and valid_BS is None:
                mtp, mtp_moe = mtp_loss(self.mtp, x, tokens_BS, targets_BS, self.embed, self.head, cos, sin,
                                        segments_BS, flex)
                loss = loss + self.cfg.mtp_weight * mtp
                if mtp_moe:  # MoE blocks: their balancing losses, the main layers' coefficients
                    extra = self.balancing_loss(mtp_moe)
                    loss, moe_loss = loss + extra, moe_loss + extra
        return ModelOutput(logits, loss, ce, moe_loss, moe, mtp, mtp_moe)

    def balancing_loss(self, moe: list[MoEOutput]) -> torch.Tensor:
        return balancing_loss(self.cfg, moe, self.embed.weight.device)

    def num_params(self) -> dict[str, int]:
        """Total and active (per token) parameter counts; embeddings counted once when tied; the MTP
        modules (training only) are in both."""
        total = sum(p.numel() for p in self.parameters())
        active = total
        for layer in self.all_moe_layers():
            E, K = layer.slots.routed, layer.cfg.top_k
            expert = layer.experts.w_gate_up_EDF.numel() + layer.experts.w_down_EFD.numel()
            active -= expert * (E - K) // E
        return {"total": total, "active": active}
