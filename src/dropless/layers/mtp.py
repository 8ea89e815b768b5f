"""Multi-token prediction (DeepSeek-V3 style), `model.mtp_depth` D, `model.mtp_weight` (lambda) and
`model.mtp_block` (each module's block: "dense" or "moe").

Legend: B batch, S sequence, D model width, V vocabulary; S_k = S - k.

The main model predicts token t+1 at position t. Module k (k = 1..D) predicts token t+1+k, keeping
the causal chain sequential (not D independent heads):

    h_0 = the main model's last hidden state (after its last block, before its final norm)
    h_k = block_k( W_k [ RMSNorm(embed(token t+k)) ; RMSNorm(h_{k-1}[t]) ] )     for t < S_k
    loss_k = CE( head(RMSNorm_k(h_k)), token t+1+k )

sharing the model's embedding and LM head (`embed`, `head`: passed in, not owned). The concatenation
is DeepSeek-V3's order, embedding first (its checkpoints' `eh_proj` [D, 2D] maps onto `proj` as it
is; hf/deepseek.py). Token t+k is the model's input tokens[t+k] (not targets[t+k-1]: a loss-masked
target is IGNORE_INDEX, not the token) and token t+1+k is targets[t+k], so module k sees the first
S_k positions only: the last k have no target inside the sequence. Its block runs causal attention
over those S_k positions with the main model's rotary positions (0..S_k-1 unpacked).
The model adds lambda * mean_k(loss_k) to its loss; `ce_loss` stays the main prediction's alone.

Ignored targets. A right-padded batch (routing replay, data/replay.py: input 0, target IGNORE_INDEX)
or a loss-masked one trains module k where targets[t+k] is real, so loss_k is the mean over those
positions, and a module with none in the batch (every sequence shorter than k + 2 tokens) is left
out of the mean over modules rather than counted as 0 or NaN. Without ignored targets this is the
plain mean over the B * S_k positions and over the D modules.

Packed documents (`segments_BS`, layers/doc_mask.py): module k at t attends within t's document, and
takes a loss only where token t+k is in that document too (its target targets[t+k] is then the
document's, or ignored by the data pipeline at the document's end). The positions whose token t+k
lies in the next document take no loss and are read by no later position of their document
(causal), so each document's MTP losses are those of the document run alone.

The block. `mtp_block = "dense"`: a dense block (the model's dense MLP width), so the modules add no
MoE layer and no balancing state. `"moe"` (DeepSeek-V3's layout): an MoE block like the main
model's; `mtp_loss` returns each module's MoEOutput beside the loss, and the model adds their aux,
sequence and z-losses with the main layers' coefficients (not times lambda). Their routers are
balanced with the main ones (the loss-free bias and quantile rules, train/health.py), but their
statistics stay out of the trainer's per-layer tables, which are the main model's
(`MoEModel.moe_layers()`); routing replay replays the main layers only (an MTP block routes itself).
The modules run in training only (`model.training`): evaluation and generation never call them,
and `dropless generate` decodes one token at a time from the main head (no speculative decoding).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .doc_mask import IGNORE_INDEX, Mask, doc_mask



class MTPModule(nn.Module):
    def __init__(self, d_model: int, block: nn.Module, norm: Callable[[], nn.Module]) -> None:
        """`block`: a transformer block (the model's Block: block(x, cos, sin) -> .x, .moe); `norm`:
        makes an RMSNorm of width d_model (the model's), so this file needs nothing from model.py."""
        super().__init__()
        self.hidden_norm, self.embed_norm, self.out_norm = norm(), norm(), norm()
        self.proj = nn.Linear(2 * d_model, d_model, bias=False)
        self.block = block

    def forward(self, h_BSD: torch.Tensor, e_BSD: torch.Tensor, cos_SF: torch.Tensor,
                sin_SF: torch.Tensor, token_ids_BS: torch.Tensor | None = None, mask: Mask = None) -> Any:
        """The block's output (`.x` [B, S, D]; `.moe`: its MoEOutput, None for a dense block).
        `token_ids_BS`: the ids `e_BSD` embeds, for an MoE block with hash routing (a function of
        the token the module reads, as in the main blocks); `mask`: the attention's (doc_mask.py)."""
        x = self.proj(torch.cat([self.embed_norm(e_BSD), self.hidden_norm(h_BSD)], dim=-1))  # [embed; hidden]
        return self.block(x, cos_SF, sin_SF, token_ids=token_ids_BS, mask_B1SL=mask)


def mtp_loss(modules: nn.ModuleList, h_BSD: torch.Tensor, tokens_BS: torch.Tensor, targets_BS: torch.Tensor,
             embed: nn.Module, head: nn.Module, cos_SF: torch.Tensor, sin_SF: torch.Tensor,
             segments_BS: torch.Tensor | None = None, flex: bool = False) -> tuple[torch.Tensor, list[Any]]:
    """(mean over the D modules of each one's cross-entropy (nats per token), fp32; aware of ignored
    targets (module note): a module with no real target in the batch is left out of the mean), and the
    MoEOutput of each MoE block (empty with dense blocks). `cos_SF`/`sin_SF`: [S, F] or per token
    [B, 1, S, F]; `segments_BS`: packed documents (module note), their mask a BlockMask if `flex`."""
    S, D = h_BSD.shape[1], len(modules)
    if S <= D:
        raise ValueError(f"model.mtp_depth={D}: module {D} predicts token t+{D + 1}, so a sequence needs "
                         f"more than {D} positions; got {S}")
    sums, counts, moe = [], [], []
    h = h_BSD
    for k, module in enumerate(modules, start=1):
        n = S - k  # positions with a target t+1+k inside the sequence
        ids_BS, tgt_BS = tokens_BS[:, k:k + n], targets_BS[:, k:k + n]  # tokens t+k, t+1+k
        real_BS = tgt_BS != IGNORE_INDEX
        mask = None
        if segments_BS is not None:
            real_BS = real_BS & (segments_BS[:, :n] == segments_BS[:, k:k + n])
            mask = doc_mask(segments_BS[:, :n], flex)
        out = module(h[:, :n], embed(ids_BS), cos_SF[..., :n, :], sin_SF[..., :n, :], ids_BS, mask)
        h = out.x
        if out.moe is not None:
            moe.append(out.moe)
        logits = head(module.out_norm(h))
        sums.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                    tgt_BS.masked_fill(~real_BS, IGNORE_INDEX).reshape(-1), reduction="sum"))
        counts.append(real_BS.sum())
    count_D = torch.stack(counts)
    loss_D = torch.stack(sums) / count_D.clamp_min(1)
    return loss_D.sum() / (count_D > 0).sum().clamp_min(1), moe
