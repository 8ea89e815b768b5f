"""Pipeline parallelism from outside the model: stages of an `MoEModel` on a (pp, edp, ep) mesh,
driven by torch.distributed.pipelining's schedules (we write no scheduler).

Legend: A micro-batches of one optimizer step on one rank (schedule calls x spec.microbatches),
B rows per schedule call, S sequence, L MoE layers of this rank's stages (in stage order), E selectable
experts.

Mesh (mesh.build_pipeline_meshes). W = pp x edp x ep ranks, pp outermost. A pipeline is the pp ranks
with the same (edp, ep) index: the group `PipelineStage` sends activations over. Inside a stage,
its edp x ep ranks are parallelised exactly as a whole model is without stages (parallelize.py: EP
over ep, FSDP2 over edp for the experts and over all of them for the rest), and are consecutive
ranks, inside a node where the world allows.

One optimizer step (`Pipeline.step`) takes this rank's share of the step as schedule calls, each a
[B, S] batch cut into spec.microbatches micro-batches. The exact MoE semantics across stages:
- every stage's balancing losses are scaled by 1 / A and ride on its output (pipeline_stage.py), so
  each micro-batch of each stage's layers counts, as in one process with A micro-batches;
- the global-batch aux loss needs the step's counts before any backward: a forward-only pass of the
  schedule (no grad) counts them per stage, all-reduced over the stage's dp ranks, as the one-process
  trainer's pre-pass;
- the step's counts per layer (summed over micro-batches, all-reduced over dp) come back for the
  bias and quantile rules, which the caller applies once per optimizer step to each stage's layers
  (the MTP modules' MoE blocks after the main layers, from the training forwards' counts: the
  pre-pass runs no MTP, as in one process);
- the MTP loss and its MoE blocks' balancing losses ride on the last stage's output, scaled as the
  rest (pipeline_stage.py); the stages pass the token ids (and, in a training call with MTP, the
  targets) on to it, and every MoE layer reads the ids under hash routing;
- the gradient norm is global: squared local shards summed over all ranks once, the embedding's
  copy counted once; clipping multiplies every rank's gradients by the same factor.
The embedding's copy on the last stage (tied embeddings, or MTP) with the first and last stage on
different ranks: it gets the first stage's gradient added (an all-reduce over the two ranks of each
pipeline), so both copies take the same update (pipeline_grads.py, with the global norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as pp_schedules
from torch.distributed.tensor import DTensor

from ..config import ParallelConfig
from ..layers import doc_mask, init
from ..model import MoEModel
from ..pipeline_config import PipelineSpec, check_stage_model
from .materialize import local_rows
from .mesh import PipelineMeshes
from .parallelize import parallelize_model
from .parallelize_ep import local_payload
from . import pipeline_grads
from .pipeline_split import model_stage_sizes
from .pipeline_stage import StageModel, StageRecord, embed_on_last

_SCHEDULE_CLASS = {"gpipe": pp_schedules.ScheduleGPipe, "1f1b": pp_schedules.Schedule1F1B,
                   "interleaved_1f1b": pp_schedules.ScheduleInterleaved1F1B,
                   "zero_bubble": pp_schedules.ScheduleInterleavedZeroBubble,
                   "zbv": pp_schedules.ScheduleZBVZeroBubble}


def check_model(spec: PipelineSpec, model: MoEModel) -> None:
    """What stages cannot run, refused by name before any process starts work."""
    check_stage_model(spec, model.cfg)


def _forward_only(schedule: pp_schedules._PipelineSchedule) -> pp_schedules._PipelineSchedule:
    """The schedule's forwards alone, in its order (the global aux loss's pre-pass). torch's runtime
    schedules (interleaved, zero bubble) keep their backward actions under `eval()`, and their
    lowering refuses an order without backwards, so the forwards are lowered here with the same
    private helpers (torch is pinned): FSDP's unshard/reshard, then the sends and receives.
    Removing backwards removes dependencies only, so the order stays deadlock-free."""
    order = getattr(schedule, "pipeline_order", None)
    if isinstance(schedule, pp_schedules._PipelineScheduleRuntime) and order:
        fwd = pp_schedules._ComputationType.FORWARD
        actions = {r: pp_schedules._add_unshard_reshard([a for a in acts if a is not None and a.computation_type == fwd])
                   for r, acts in order.items()}
        ranks = schedule.stage_index_to_group_rank
        schedule.pipeline_order_with_comms = pp_schedules._add_send_recv(
            actions, stage_to_rank=lambda s: ranks[s], num_stages=schedule._num_stages)
    return schedule


def _whole_backward() -> Callable[[], None]:
    """The weight step of a stage whose backward runs whole: as `PipelineStage`'s dw_builder, the
    stage's input-gradient step becomes its full backward and this, its deferred weight step, has
    nothing left to do. The stage with the MTP modules needs it under the zero-bubble schedules.
    Their split backward (torch's stage_backward_weight) computes the weight gradients one group of
    weights at a time, each walk starting from where its weights meet the path from the stage's
    input, with retain_graph off. The head meets that path twice, in the main logits and in the MTP
    logits, and the first lies downstream of the second (the MTP loss rides on the hidden states
    before the head); a tied embedding also meets it at the MTP input. So the head's walk runs
    through the final norm and the MTP block and frees what the other groups' walks need (a
    "backward through the graph a second time" error). Other stages keep the split."""
    return lambda: None


@dataclass
class PipelineStep:
    """What one optimizer step's passes return (device tensors; the host reads them on log steps)."""

    ce: torch.Tensor | None  # mean cross-entropy over the step's micro-batches (ranks with the last stage)
    moe_loss: torch.Tensor  # this rank's stages' balancing losses, mean over the micro-batches
    # this rank's MoE layers (its stages' main layers, then the MTP modules'): pairs per expert,
    # summed over the step and dp
    counts_LE: torch.Tensor
    records: list[list[StageRecord]]  # per micro-batch, this rank's stages' records (MoE outputs, stats)
    # model.mtp_depth > 0, ranks with the last stage: the MTP modules' loss (without model.mtp_weight),
    # mean over the micro-batches; None elsewhere
    mtp: torch.Tensor | None = None


class Pipeline:
    def __init__(self, model: MoEModel, spec: PipelineSpec, meshes: PipelineMeshes, parallel: ParallelConfig,
                 device: torch.device, batch: int, seq_len: int, seed: int,
                 logits_dtype: torch.dtype = torch.float32, packed: bool = False) -> None:
        """This rank's stages of `model` (built on meta: only this rank's shards are ever allocated),
        parallelised inside the stage as without stages (EP over ep, FSDP2 over the stage's dp ranks;
        parallelize.py), initialised from `seed` (the one-process values). Every schedule call takes
        [batch, seq_len] tokens; the last stage's logits come out in `logits_dtype` (the autocast
        dtype, when the caller runs the steps under one). `packed`: every call also takes the
        document ids of packed windows (segments_BS: attention within each document, model.py)."""
        check_model(spec, model)
        spec.check_batch(batch)
        self.spec, self.meshes, self.device, self.cfg = spec, meshes, device, model.cfg
        self.pp_rank, self.dp = meshes.pp.get_local_rank(), meshes.stage.world
        self.ep = meshes.stage.mesh.size(1)
        sizes = model_stage_sizes(spec, model, seq_len)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = sizes
        self.stage_ids = spec.stages_of(self.pp_rank)
        self.modules = [StageModel(model, s, spec.num_stages, starts[s], sizes[s], packed) for s in self.stage_ids]
        self.expert_names: list[str] = []
        sharded = self.dp > 1
        for m in self.modules:
            if sharded:
                self.expert_names += parallelize_model(m, meshes.stage, parallel)
            local_payload(m, parallel.dispatch_dtype)
            m.materialize(device)
        where = local_rows(meshes.stage, self.expert_names) if sharded else init.whole
        with torch.no_grad():
            for m in self.modules:
                init.init_parameters(m, seed, where)
        self.batch, self.seq_len, self._logits_dtype, self.packed = batch, seq_len, logits_dtype, packed
        self.has_first = any(m.is_first for m in self.modules)
        self.has_last = any(m.is_last for m in self.modules)
        # the embedding's copy on the last stage (pipeline_stage.py): its gradient summed with the first's
        self.tied_group = pipeline_grads.tie_group(spec) if embed_on_last(model.cfg) else None
        # scale_grads off: each micro-batch's loss is already divided by the step's micro-batches
        # (pipeline_stage.py), and the schedule's own scaling would also shrink earlier calls' gradients
        self.schedule = self._schedule(batch, spec.microbatches, self._loss, grad=True)
        self._eval_schedule = _forward_only(self._schedule(batch, spec.microbatches, None, grad=False))
        self._ce_scale = 1.0

    def _schedule(self, batch: int, microbatches: int, loss_fn, grad: bool) -> pp_schedules._PipelineSchedule:  # noqa: ANN001
        """The spec's schedule over this rank's stages for [batch, seq_len] calls. Static shapes: torch's
        dynamic mode would infer them by running each stage's forward once more (on uninitialised
        activations), which would also count as a micro-batch in `records`."""
        b, S, D, V = batch // microbatches, self.seq_len, self.cfg.d_model, self.cfg.vocab_size
        tokens = torch.empty(b, S, dtype=torch.long, device="meta")
        hidden = torch.empty(b, S, D, device="meta", requires_grad=grad)
        logits = torch.empty(b, S, V, dtype=self._logits_dtype, device="meta", requires_grad=grad)
        carry = self.modules[0].carry  # the integer tensors passed on (pipeline_stage.py), then the targets
        targets = (tokens,) if self._with_targets(grad) else ()

        def ints(m: StageModel, input: bool) -> tuple[torch.Tensor, ...]:
            return (tokens,) * sum(1 for n in carry if not (input and m.is_first and n == "ids")) + targets

        stages = [PipelineStage(m, s, self.spec.num_stages, self.device, group=self.meshes.pp_group,
                                input_args=((tokens if m.is_first else hidden), *ints(m, True)),
                                output_args=logits if m.is_last else (hidden, *ints(m, False)),
                                dw_builder=_whole_backward if m.mtp is not None else None)
                  for m, s in zip(self.modules, self.stage_ids)]
        cls = _SCHEDULE_CLASS[self.spec.schedule]
        return cls(stages[0] if self.spec.schedule in ("gpipe", "1f1b") else stages, microbatches,
                   loss_fn=loss_fn, scale_grads=False)

    def _with_targets(self, grad: bool) -> bool:
        """Whether a schedule's calls carry the targets to the last stage: a training call with MTP."""
        return grad and self.cfg.mtp_depth > 0

    def _ce(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """model.py's cross-entropy: with packed documents 0 (not NaN) where no target is left."""
        ce_of = doc_mask.packed_cross_entropy if self.packed else F.cross_entropy
        return ce_of(logits_BSV.float().flatten(0, 1), targets_BS.flatten())

    def _loss(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        return self._ce(logits_BSV, targets_BS) * self._ce_scale

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, each once (zbv's rank 0 holds the tied embedding in two stages)."""
        seen: dict[int, torch.nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name in the whole model, parameter), each once."""
        seen: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for m in self.modules:
            for n, p in m.named_parameters():
                seen.setdefault(id(p), (n, p))
        return list(seen.values())

    def moe_layers(self) -> list[torch.nn.Module]:
        return [layer for m in self.modules for layer in m.moe_layers()]

    def mtp_moe_layers(self) -> list[torch.nn.Module]:
        """The MTP modules' MoE blocks, on the rank of the last stage (after `moe_layers()` in the counts)."""
        return [layer for m in self.modules for layer in m.mtp_moe_layers()]

    def _call(self, schedule: pp_schedules._PipelineSchedule, x_BS: torch.Tensor, y_BS: torch.Tensor,
              seg_BS: torch.Tensor | None, losses: list | None) -> None:
        """One schedule call: training (`losses` a list) or the pre-pass (None). The first stage takes
        the tokens, the documents' ids, then (training with MTP) the targets (pipeline_stage.py)."""
        args: tuple[torch.Tensor, ...] = ()
        if self.has_first:
            args = (x_BS, *((seg_BS,) if self.packed else ()))
            args += (y_BS,) if self._with_targets(losses is not None) else ()
        target = y_BS if self.has_last else None
        schedule.step(*args, target=target, losses=losses, return_outputs=False) if losses is not None \
            else schedule.eval(*args)

    def _counts(self, records: list[list]) -> torch.Tensor:
        """Pairs per expert of this rank's MoE layers (the main ones, then the MTP modules' where the
        forwards ran them), summed over micro-batches and dp ranks."""
        per_micro = [[s.tokens_per_expert_E for r in rs for s in r.stats] +
                     [s.tokens_per_expert_E for r in rs for s in r.mtp_stats] for rs in records]
        counts = torch.stack([torch.stack(c) for c in per_micro]).sum(0).float() if per_micro and per_micro[0] \
            else torch.zeros(0, device=self.device)
        if self.dp > 1 and counts.numel():
            dist.all_reduce(counts, group=self.meshes.stage.dp_group)
        return counts

    def _take(self) -> list[list]:
        """Records of the last pass, per micro-batch, this rank's stages in order."""
        per_stage = [m.take_records() for m in self.modules]
        return [list(rs) for rs in zip(*per_stage)]

    def step(self, batches: list[tuple[torch.Tensor, ...]]) -> PipelineStep:
        """Forward and backward over this rank's share of one optimizer step: `batches` of
        (tokens_BS, targets_BS), with segments_BS third when `packed`, one schedule call each (module note). The gradients accumulate; the
        caller takes the norm (`clip_grad_norm_`), steps the optimizer and applies the balancing
        rules with the returned counts."""
        A = len(batches) * self.spec.microbatches
        for x, *rest in batches:
            if len(rest) != 1 + self.packed:
                raise ValueError(f"a pipeline step takes (tokens, targets{', segments' if self.packed else ''}) "
                                 f"per call, got {1 + len(rest)} tensors")
            if tuple(x.shape) != (self.batch, self.seq_len):
                raise ValueError(f"a pipeline step takes [{self.batch}, {self.seq_len}] tokens per call, got "
                                 f"{list(x.shape)}")
        for m in self.modules:
            m.loss_scale, m.num_terms, m.global_counts_LE = 1.0 / A, A * self.dp, None
        self._ce_scale = 1.0 / A
        # the pre-pass is collective over the pipeline: every rank runs it, with MoE layers or not
        if self.cfg.moe.balance.global_aux_loss_coeff > 0 and self.cfg.moe_layer_ids:
            with torch.no_grad():
                for x, y, *seg in batches:
                    self._call(self._eval_schedule, x, y, seg[0] if seg else None, None)
            counts = self._counts(self._take())
            at = 0
            for m in self.modules:
                n = len(m.moe_layers())
                m.global_counts_LE, at = counts[at:at + n], at + n
        ce = torch.zeros((), device=self.device)
        for x, y, *seg in batches:
            losses: list[torch.Tensor] = []
            self._call(self.schedule, x, y, seg[0] if seg else None, losses)
            for loss in losses:
                ce = ce + loss.detach()
        records = self._take()
        self.sync_tied_grads()
        moe = torch.stack([r.moe_loss for rs in records for r in rs]).sum() / A if records and records[0] else \
            torch.zeros((), device=self.device)
        mtp = [r.mtp_loss for rs in records for r in rs if r.mtp_loss is not None]
        return PipelineStep(ce if self.has_last else None, moe, self._counts(records), records,
                            torch.stack(mtp).sum() / A if mtp else None)

    def _owner(self, stage: int) -> int:
        """The pp rank that runs `stage`."""
        return next(p for p in range(self.spec.pp_size) if stage in self.spec.stages_of(p))

    @torch.no_grad()
    def forward_only(self, x_BS: torch.Tensor, y_BS: torch.Tensor | None = None,
                     segments_BS: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list]:
        """One forward of [B, S] tokens through the pipeline, whole (evaluation, the routing probe):
        the mean cross-entropy against `y_BS` on every rank of the pipeline (broadcast from the last
        stage's rank; None without targets), and this rank's stages' records. Collective over the
        pipeline. No schedule: one micro-batch cannot overlap anything, and torch's schedules want at
        least as many micro-batches as stages; every rank runs its stages in increasing order,
        receiving a stage's input from the rank of the stage before (or from itself) and sending its
        output on, so the sends and receives meet in the same order on both sides. Packed documents:
        every rank of a pipeline holds the batch, so `segments_BS` is passed to each stage, not sent."""
        B, S = x_BS.shape
        group, me = self.meshes.pp_group, self.pp_rank
        local: dict[int, torch.Tensor] = {}
        ce = torch.zeros((), device=self.device)
        for m in sorted(self.modules, key=lambda m: m.index):
            s = m.index
            if m.is_first:
                h = x_BS
            elif self._owner(s - 1) == me:
                h = local.pop(s - 1)
            else:
                h = torch.empty(B, S, self.cfg.d_model, device=self.device)  # the residual stream is fp32
                dist.recv(h, group=group, group_src=self._owner(s - 1))
            out = m(h, ids_BS=x_BS, segments_BS=segments_BS)
            if isinstance(out, tuple):
                out = out[0]
            if m.is_last:
                if y_BS is not None:
                    ce_of = doc_mask.packed_cross_entropy if segments_BS is not None else F.cross_entropy
                    ce = ce_of(out.float().flatten(0, 1), y_BS.flatten())
            elif self._owner(s + 1) == me:
                local[s] = out
            else:
                dist.send(out.float().contiguous(), group=group, group_dst=self._owner(s + 1))
        records = self._take()
        if y_BS is None:
            return None, records
        ce = ce.detach().float().reshape(())
        dist.broadcast(ce, group=group, group_src=self._owner(self.spec.num_stages - 1))
        return ce, records

    def sync_tied_grads(self) -> None:
        """The embedding's gradient summed over the first and the last stage's copies (pipeline_grads.py)."""
        pipeline_grads.sync_tied_grads(self)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm, the gradients clipped to `max_norm` (pipeline_grads.py)."""
        return pipeline_grads.clip_grad_norm_(self, max_norm)
