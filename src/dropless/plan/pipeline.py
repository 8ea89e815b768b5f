"""What each rank of a pipeline holds, and how many micro-batches of its stages are alive at once:
the planner's view of `parallel.pp_size` > 1 (model.py turns it into bytes).

The split is the trainer's: `distributed/pipeline_split.model_stage_sizes` on the model built on meta (the
explicit `parallel.pp_layers`, or the cost-balanced cut), and `PipelineSpec.stages_of` says which
rank runs which stage. A rank holds its stages' blocks; the first stage also the embedding, the last
the final norm and the head (and the MTP modules), and with tied embeddings or MTP the last stage keeps
its own copy of the embedding (distributed/pipeline_stage.py), so the embedding counts on both end
ranks (once where zbv puts both end stages on rank 0).

Micro-batches in flight. A stage keeps one micro-batch's activations from its forward to its
backward. The order of the forwards and backwards on a rank is the schedule's, and it is read from
torch's own schedule, never re-derived:
- `gpipe` and `1f1b` run their `_step_microbatches` loop: GPipe every forward before any backward
  (m alive), 1F1B `min(m, pp - rank)` warm-up forwards, then one backward before each forward
  (torch's IR for the single-stage schedules, `pipeline_order`, is not what they run: it is not read);
- the multi-stage schedules (`interleaved_1f1b`, `zero_bubble`, `zbv`) run their `pipeline_order`
  action by action. It is built here by torch's schedule class itself on stand-in stages (the class
  reads only the stages' indices and the group's size and rank), and walked: a forward adds its
  stage's bytes, a full backward (B) frees them, and the zero-bubble split backward frees them at
  the weight gradient (W), not at the input gradient (I): the weight gradients read the saved
  inputs of every matmul, which is most of what a block keeps. The peak of that walk, with each
  stage's own bytes, is the rank's activations.

Receive buffers. torch's `PipelineStage` allocates, once, a receive buffer per micro-batch for the
input of every stage but the first (the hidden states, [b, S, D] fp32, and the integer tensors the
stages pass on: the token ids under hash routing or MTP, the documents' ids of packed windows
(planned when `data.document_mask` is set; chat data turns it on by itself), MTP's targets, [b, S]
int64 each) and for the output gradient of every stage but the last ([b, S, D]): `2 m b S D 4`
bytes and the integers for a middle stage. They live as long as the schedule (component
`pp_buffers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from torch import nn
from torch.distributed.pipelining import schedules as pp_schedules

from ..distributed.pipeline_split import model_stage_sizes
from ..distributed.pipeline_stage import carried_names, embed_on_last
from ..model import MoEModel
from ..pipeline_config import PipelineSpec

# the classes distributed/pipeline.py builds, by schedule name
MULTI_CLASS = {"interleaved_1f1b": pp_schedules.ScheduleInterleaved1F1B,
               "zero_bubble": pp_schedules.ScheduleInterleavedZeroBubble,
               "zbv": pp_schedules.ScheduleZBVZeroBubble}
_ADDS = {pp_schedules.FORWARD}
_FREES = {pp_schedules.FULL_BACKWARD, pp_schedules.BACKWARD_WEIGHT}


@dataclass(frozen=True)
class RankShape:
    """One pipeline rank: its stages (in the rank's order) and the blocks of each."""

    pp_rank: int
    stages: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]  # per stage of `stages`: the global block indices
    first: bool  # holds stage 0 (the embedding)
    last: bool  # holds the last stage (norm, head, MTP)


def ranks(spec: PipelineSpec, model: MoEModel, seq_len: int) -> list[RankShape]:
    """Every rank of the pipeline, split as the trainer splits `model` (built on meta)."""
    sizes = model_stage_sizes(spec, model, seq_len)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    out = []
    for r in range(spec.pp_size):
        stages = tuple(spec.stages_of(r))
        out.append(RankShape(r, stages, tuple(tuple(range(starts[s], starts[s] + sizes[s])) for s in stages),
                             0 in stages, spec.num_stages - 1 in stages))
    return out


class RankModules(nn.Module):
    """The modules one rank holds, under the model's attribute names (None where the rank has
    none), so the planner's parameter count reads it as it reads a whole model."""

    def __init__(self, model: MoEModel, shape: RankShape) -> None:
        super().__init__()
        self.embed = model.embed if shape.first or (shape.last and embed_on_last(model.cfg)) else None
        self.blocks = nn.ModuleList([model.blocks[i] for blocks in shape.blocks for i in blocks])
        self.norm = model.norm if shape.last else None
        self.head = model.head if shape.last else None
        self.mtp = model.mtp if shape.last else nn.ModuleList()

    def moe_layers(self) -> list[nn.Module]:
        return [b.ffn for b in self.blocks if b.is_moe]


def _stand_in(stage: int, spec: PipelineSpec, rank: int) -> SimpleNamespace:
    n = spec.num_stages
    return SimpleNamespace(stage_index=stage, num_stages=n, group_rank=rank, group_size=spec.pp_size,
                           is_first=stage == 0, is_last=stage == n - 1, submod=None)


def actions(spec: PipelineSpec, rank: int) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) in the order `rank` runs them; kind "F" forward, "B" the whole
    backward, "I" / "W" the zero-bubble input and weight halves (module note)."""
    m, p = spec.microbatches, spec.pp_size
    if spec.schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    if spec.schedule == "1f1b":  # torch's Schedule1F1B._step_microbatches
        warm = min(m, p - rank)
        out = [("F", rank, i) for i in range(warm)]
        for i in range(m):
            out.append(("B", rank, i))
            if warm + i < m:
                out.append(("F", rank, warm + i))
        return out
    stages = [_stand_in(s, spec, rank) for s in spec.stages_of(rank)]
    schedule = MULTI_CLASS[spec.schedule](stages, m, loss_fn=None, scale_grads=False)
    kind = {pp_schedules.FORWARD: "F", pp_schedules.FULL_BACKWARD: "B",
            pp_schedules.BACKWARD_INPUT: "I", pp_schedules.BACKWARD_WEIGHT: "W"}
    return [(kind[a.computation_type], a.stage_index, a.microbatch_index)
            for a in schedule.pipeline_order[rank] if a is not None and a.computation_type in kind]


def in_flight(spec: PipelineSpec, rank: int, stage_bytes: dict[int, int]) -> tuple[int, dict[int, int]]:
    """The most activation bytes `rank` holds at once, walking its actions with each stage's bytes
    per micro-batch, and how many micro-batches of each stage are alive then."""
    alive: dict[int, int] = {s: 0 for s in stage_bytes}
    now = peak = 0
    at_peak = dict(alive)
    for kind, stage, _ in actions(spec, rank):
        if kind == "F":
            alive[stage] += 1
            now += stage_bytes[stage]
        elif kind in ("B", "W"):
            alive[stage] -= 1
            now -= stage_bytes[stage]
        if now > peak:
            peak, at_peak = now, dict(alive)
    return peak, at_peak


def carried_ints(model: MoEModel, packed: bool) -> int:
    """How many [rows, S] int64 tensors a stage receives beside the hidden states in a training call
    (module note; distributed/pipeline.py's input specs)."""
    return len(carried_names(model.cfg, packed)) + (model.cfg.mtp_depth > 0)


def recv_buffer_bytes(spec: PipelineSpec, shape: RankShape, rows: int, seq_len: int, width: int,
                      ints: int = 0) -> int:
    """torch's receive buffers on this rank (module note): per micro-batch, an input buffer for each
    stage but the first ([rows, S, D] fp32 and `ints` [rows, S] int64) and an output-gradient buffer
    for each stage but the last ([rows, S, D] fp32)."""
    hidden, n = rows * seq_len * width * 4, spec.num_stages
    inputs = sum(s != 0 for s in shape.stages) * (hidden + ints * rows * seq_len * 8)
    grads = sum(s != n - 1 for s in shape.stages) * hidden
    return spec.microbatches * (inputs + grads)
