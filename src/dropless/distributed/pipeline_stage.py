"""One pipeline stage of an `MoEModel`: a contiguous run of its blocks, with the embedding on the first
stage and the final norm, the LM head and the multi-token prediction modules on the last, as an
`nn.Module` that torch.distributed.pipelining can run (tensors in, tensors out).

Legend: B micro-batch rows, S sequence, D model width, V vocabulary, L this stage's MoE layers,
E selectable experts.

Names. A stage holds the model's own modules under the model's names: `embed`, `blocks.<i>` (a
`ModuleDict` keyed by the block's index in the whole model), `norm`, `head`, `mtp.<k>`. So a
parameter's name in a stage is its name in the model: initial weights (a function of seed and name,
layers/init.py) and checkpoints agree with one process at any split. With tied embeddings the last
stage also holds `embed` (its head's weight is `embed.weight`), and so it does with MTP (the modules
embed the shifted tokens, layers/mtp.py), tied or not; the pipeline adds that copy's gradient to the
first stage's (pipeline_grads.py).

What a stage passes on. Besides the hidden states, a stage hands the next one the integer tensors
later stages read, in `carry` order: the token ids (`ids`: hash routing reads them at every MoE
layer, the MTP modules embed them) and the packed documents' ids (`segments`: each stage makes its
own mask and positions from them); in a training call with MTP the targets follow (the modules'
cross-entropy needs them on the last stage). The first stage's input is the tokens themselves, then
the rest. The schedule sends these on and never differentiates them.

Losses. The schedule backpropagates each stage's output and nothing else, so a stage's balancing
losses (aux, z, sequence aux, and the global-batch aux from the step's counts) ride on its output:
`_AddLoss` passes the hidden states on unchanged (before the last stage's head) and, in the backward,
hands the loss a gradient of 1. On the last stage the MTP loss (times model.mtp_weight) and its MoE
blocks' balancing losses ride the same way, as model.py adds them; the MTP modules run in a training
call only (grad enabled, targets given: not in the global aux pre-pass, evaluation or the probe,
as one process runs them in training forwards with targets only), and their MoE blocks take no
global-batch aux term (one process's trainer adds it for the main layers only). The loss is
pre-scaled (`loss_scale`, 1 / the step's micro-batches) exactly as the one-process trainer scales
each micro-batch's loss, so the gradients are the one-process gradients.

Statistics. Each forward appends its layers' `MoEStats` and its balancing loss (detached) to
`records`; the pipeline takes them after the schedule call (stats are returned through the pipeline,
never kept in globals).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import ModelConfig
from ..expert_slots import ExpertSlots
from ..layers import balance, doc_mask
from ..layers.moe import MoEOutput, MoEStats
from ..layers.mtp import mtp_loss
from ..layers.rotary import rotary_at, rotary_tables
from ..model import MoEModel, balancing_loss


class _AddLoss(torch.autograd.Function):
    """h in the forward; in the backward, h's gradient passed on and a gradient of 1 for `loss`."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.loss_meta = (loss.dtype, loss.device)
        # a copy, not a view: the zero-bubble schedules detach a stage's output in place
        return h.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        dtype, device = ctx.loss_meta
        return grad, torch.ones((), dtype=dtype, device=device)


@dataclass(frozen=True)
class StageRecord:
    """One forward of a stage: its MoE layers' outputs without activations or graph (losses detached,
    statistics; what the routing health reads), its balancing loss (detached; with the MTP blocks'),
    and on the last stage of a training call with MTP the modules' loss (detached, without
    model.mtp_weight) and their MoE blocks' outputs."""

    moe: list[MoEOutput]
    moe_loss: torch.Tensor
    mtp_loss: torch.Tensor | None = None
    mtp_moe: list[MoEOutput] = field(default_factory=list)

    @property
    def stats(self) -> list[MoEStats]:
        return [m.stats for m in self.moe]

    @property
    def mtp_stats(self) -> list[MoEStats]:
        return [m.stats for m in self.mtp_moe]


def _detached(m: MoEOutput) -> MoEOutput:
    return MoEOutput(_NO_Y, m.aux_loss.detach(), m.z_loss.detach(), m.stats)


_NO_Y = torch.empty(0)


def embed_on_last(cfg: ModelConfig) -> bool:
    """Whether the last stage holds a copy of the embedding: the tied head's weight, or what the MTP
    modules embed the shifted tokens with (module note)."""
    return cfg.tie_embeddings or cfg.mtp_depth > 0


def carried_names(cfg: ModelConfig, packed: bool) -> tuple[str, ...]:
    """The integer tensors every stage passes on, in order (module note): the token ids for hash
    routing or MTP, the documents' ids when `packed`."""
    ids = cfg.moe.router.strategy == "hash" or cfg.mtp_depth > 0
    return (("ids",) if ids else ()) + (("segments",) if packed else ())


class StageModel(nn.Module):
    def __init__(self, model: MoEModel, index: int, num_stages: int, first_block: int, n_blocks: int,
                 packed: bool = False) -> None:
        """Stage `index` of `num_stages`, blocks [first_block, first_block + n_blocks) of `model`
        (built on meta or materialised; the stage shares its modules). `packed`: every call carries
        the documents' ids (module note)."""
        super().__init__()
        cfg = self.cfg = model.cfg
        self.index, self.is_first, self.is_last = index, index == 0, index == num_stages - 1
        self.embed = model.embed if self.is_first or (self.is_last and embed_on_last(cfg)) else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first_block, first_block + n_blocks)})
        self.norm = model.norm if self.is_last else None
        self.head = model.head if self.is_last else None
        self.mtp = model.mtp if self.is_last and len(model.mtp) else None
        self.carry = carried_names(cfg, packed)
        rules = model.init_rules()
        names = {n for n, _ in self.named_parameters()}
        self._rules = {n: r for n, r in rules.items() if n in names}
        cos, sin = rotary_tables(cfg.max_seq_len, cfg.rope_width, cfg.rope_theta, cfg.rope_yarn)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.loss_scale = 1.0  # 1 / micro-batches of the optimizer step (set by the pipeline)
        self.global_counts_LE: torch.Tensor | None = None  # the step's counts, for the global aux loss
        self.num_terms = 1  # the global aux loss's n: micro-batches of the step over all dp ranks
        self.records: list[StageRecord] = []

    def init_rules(self) -> dict:
        """The model's own rules for this stage's parameters (layers/init.py)."""
        return dict(self._rules)

    def moe_layers(self) -> list[nn.Module]:
        return [b.ffn for b in self.blocks.values() if b.is_moe]

    def mtp_moe_layers(self) -> list[nn.Module]:
        """The MTP modules' MoE blocks (the last stage, model.mtp_block "moe"; else none)."""
        return [m.block.ffn for m in self.mtp if m.block.is_moe] if self.mtp is not None else []

    def expert_slots(self) -> ExpertSlots:
        """As MoEModel.expert_slots (parallelize.py asks it)."""
        layers = self.moe_layers()
        return layers[0].slots if layers else ExpertSlots.from_config(self.cfg.moe)

    def materialize(self, device: torch.device) -> None:
        """Allocate this stage's parameters on `device` (uninitialised), tie the head again."""
        self.to_empty(device=device)
        if self.is_last and self.cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rotary_tables(self.cfg.max_seq_len, self.cfg.rope_width, self.cfg.rope_theta, self.cfg.rope_yarn)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        for module in self.modules():  # the routers' buffers
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()

    def forward(self, x: torch.Tensor, *carried: torch.Tensor, ids_BS: torch.Tensor | None = None,
                segments_BS: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """tokens_BS (first stage) or h_BSD in; h_BSD out, or logits_BSV from the last stage. `carried`:
        what the schedule hands over, in `carry` order, then the targets in a training call with MTP
        (module note); the stage passes them on beside h_BSD. A call outside a schedule (the
        pipeline's forward_only) gives `ids_BS` and `segments_BS` by name instead, and no targets."""
        ids_BS, segments_BS, targets_BS = self._unpack(x, carried, ids_BS, segments_BS)
        h = self.embed(x) if self.is_first else x
        S = h.shape[1]
        flex = doc_mask.uses_flex(h.device, (self.cfg.head_width, self.cfg.value_width))
        cos, sin, mask = self.rope_cos[:S], self.rope_sin[:S], None
        if segments_BS is not None:
            pos = doc_mask.positions_of(segments_BS)
            cos, sin = rotary_at(self.rope_cos, 0, S, pos), rotary_at(self.rope_sin, 0, S, pos)
            mask = doc_mask.doc_mask(segments_BS, flex)
        moe: list[MoEOutput] = []
        for block in self.blocks.values():
            out = block(h, cos, sin, token_ids=ids_BS, mask_B1SL=mask)
            h = out.x
            if out.moe is not None:
                moe.append(out.moe)
        moe_loss = loss = self._balancing(moe, h.shape[0] * S)
        mtp = None
        mtp_moe: list[MoEOutput] = []
        if self.mtp is not None and targets_BS is not None and torch.is_grad_enabled():  # model.py's sums
            mtp, mtp_moe = mtp_loss(self.mtp, h, ids_BS, targets_BS, self.embed, self.head, cos, sin,
                                    segments_BS, flex)
            moe_loss = moe_loss + balancing_loss(self.cfg, mtp_moe, self.rope_cos.device)
            loss = moe_loss + self.cfg.mtp_weight * mtp
        self.records.append(StageRecord([_detached(m) for m in moe], moe_loss.detach(),
                                        None if mtp is None else mtp.detach(), [_detached(m) for m in mtp_moe]))
        if (moe or mtp is not None) and torch.is_grad_enabled():  # before the head: [B, S, D], not [B, S, V]
            h = _AddLoss.apply(h, loss * self.loss_scale)
        if self.is_last:
            return self.head(self.norm(h))
        # (a forward_only call may leave a carried tensor out: it passes each stage its own)
        passed = [t for n, t in (("ids", ids_BS), ("segments", segments_BS), ("targets", targets_BS))
                  if (n in self.carry or n == "targets") and t is not None]
        # contiguous, as sends want: the first stage's may be views of the caller's batch (x[:, :-1])
        return (h, *(t.contiguous() for t in passed)) if passed else h

    def _unpack(self, x: torch.Tensor, carried: tuple[torch.Tensor, ...], ids_BS: torch.Tensor | None,
                segments_BS: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """(ids_BS, segments_BS, targets_BS) of this call (forward's note); the first stage's ids are
        its input tokens."""
        targets_BS = None
        if carried:
            names = [n for n in self.carry if not (self.is_first and n == "ids")]
            if len(carried) not in (len(names), len(names) + 1):
                raise ValueError(f"pipeline stage {self.index} takes {names} (then the targets) after its input, "
                                 f"got {len(carried)} tensors")
            got = dict(zip([*names, "targets"], carried))
            ids_BS, segments_BS, targets_BS = got.get("ids"), got.get("segments"), got.get("targets")
        if self.is_first:
            ids_BS = x
        return ids_BS, segments_BS, targets_BS

    def _balancing(self, moe: list[MoEOutput], num_tokens: int) -> torch.Tensor:
        """This micro-batch's balancing losses of this stage's layers, with their coefficients."""
        loss = balancing_loss(self.cfg, moe, self.rope_cos.device)
        bal = self.cfg.moe.balance
        if bal.global_aux_loss_coeff > 0 and moe and self.global_counts_LE is not None:
            for i, m in enumerate(moe):
                loss = loss + bal.global_aux_loss_coeff * balance.global_aux_loss(
                    m.probs_mean_E, self.global_counts_LE[i], self.cfg.moe.top_k,
                    num_tokens=num_tokens, num_terms=self.num_terms)
        return loss

    def take_records(self) -> list[StageRecord]:
        records, self.records = self.records, []
        return records
