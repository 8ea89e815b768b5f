"""Where a pipeline's stages begin and end, and which rank runs which stage.

A `PipelineSpec` is the pipeline's shape: `pp_size` ranks in a pipeline, `stages_per_rank` model
chunks on each (2 or more for the interleaved schedules), `microbatches` per schedule call, and an
optional explicit split (`layers`: how many blocks each stage holds, in order). Its checks are the
`ValueError`s a user meets before any process starts work, naming the `parallel.pp_*` field.

The split. Without an explicit list, the blocks are cut into contiguous stages that minimise the
most expensive stage (an exact linear-partition dynamic programme: n_layers x stages is tiny). A
stage's cost is the sum of its blocks' per-token forward FLOPs, read from the built modules (on
meta: nothing is allocated), plus the LM head's on the last stage: 2 x active parameters for each
matmul, and the attention's score and value products, 4 x seq_len x the query width, averaged over
causal positions (half). The first stage's embedding is a lookup: no FLOPs.

Placement of the S = pp_size x stages_per_rank stages on pp ranks:
- "loop" (gpipe, 1f1b, interleaved_1f1b, zero_bubble): rank r runs stages r, r + pp, r + 2 pp, ...
- "v" (zbv): two stages per rank, rank r runs r and 2 pp - 1 - r, so the first and last stages meet
  on rank 0 (the schedule's V shape).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
MULTI = ("interleaved_1f1b", "zero_bubble", "zbv")  # schedules that take a list of stages per rank


def _fail(name: str, value: object, why: str) -> None:
    raise ValueError(f"{name}={value!r}: {why}")


@dataclass(frozen=True)
class PipelineSpec:
    pp_size: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1  # per schedule call; each is batch / microbatches rows
    stages_per_rank: int = 1  # virtual stages (interleaved_1f1b, zero_bubble: >= 1; zbv: 2)
    layers: tuple[int, ...] = ()  # blocks per stage, in order; () = balanced by cost

    def __post_init__(self) -> None:
        for name, field in (("pp_size", "pp_size"), ("microbatches", "pp_microbatches"),
                            ("stages_per_rank", "pp_stages_per_rank")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(f"parallel.{field}", v, "must be a positive integer")
        if self.schedule not in SCHEDULES:
            _fail("parallel.pp_schedule", self.schedule, f"must be one of {', '.join(SCHEDULES)}")
        if self.schedule == "interleaved_1f1b" and self.stages_per_rank < 2:
            _fail("parallel.pp_schedule", self.schedule, f"with parallel.pp_stages_per_rank={self.stages_per_rank}: "
                  "an interleaved schedule runs 2 or more stages per rank")
        if self.schedule == "zbv" and self.stages_per_rank != 2:
            _fail("parallel.pp_schedule", self.schedule,
                  f"with parallel.pp_stages_per_rank={self.stages_per_rank}: zbv runs exactly 2 stages per rank")
        if self.schedule in ("gpipe", "1f1b") and self.stages_per_rank != 1:
            _fail("parallel.pp_stages_per_rank", self.stages_per_rank,
                  f"with parallel.pp_schedule={self.schedule!r}: one stage per rank (interleaved_1f1b, "
                  "zero_bubble and zbv take several)")
        if self.schedule in MULTI:  # torch's runtime schedules cut the micro-batches into equal rounds
            rounds = max(1, self.microbatches // self.pp_size)
            if self.microbatches % rounds:
                _fail("parallel.pp_microbatches", self.microbatches,
                      f"with parallel.pp_schedule={self.schedule!r} and pp_size={self.pp_size}: must be a "
                      f"multiple of its {rounds} rounds (a multiple of pp_size, or fewer than 2 x pp_size)")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.layers):
            _fail("parallel.pp_layers", list(self.layers), "every stage holds a positive number of blocks")
        if self.layers and len(self.layers) != self.num_stages:
            _fail("parallel.pp_layers", list(self.layers), f"lists {len(self.layers)} stages; the pipeline has "
                  f"pp_size x pp_stages_per_rank = {self.num_stages}")

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.stages_per_rank

    def check_model(self, n_layers: int) -> None:
        if self.num_stages > n_layers:
            _fail("parallel.pp_size", self.pp_size, f"with parallel.pp_stages_per_rank={self.stages_per_rank} that "
                  f"is {self.num_stages} stages, more than model.n_layers={n_layers}")
        if self.layers and sum(self.layers) != n_layers:
            _fail("parallel.pp_layers", list(self.layers), f"covers {sum(self.layers)} blocks; the model has "
                  f"model.n_layers={n_layers}")

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.microbatches:
            _fail("parallel.pp_microbatches", self.microbatches, f"does not divide train.batch_size={batch_size}")

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stage indices rank `pp_rank` of the pipeline runs, in its order (module note)."""
        if self.schedule == "zbv":
            return [pp_rank, 2 * self.pp_size - 1 - pp_rank]
        return [pp_rank + v * self.pp_size for v in range(self.stages_per_rank)]


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_cost(block: nn.Module, seq_len: int) -> float:
    """Per-token forward FLOPs of a built `model.Block` (module note): routed experts count K of E."""
    active = _params(block)
    ffn = block.ffn
    if getattr(block, "is_moe", False):
        experts = _params(ffn.experts)
        active -= experts - experts * ffn.cfg.top_k // ffn.slots.routed
    out = getattr(block.attn, "out", None)  # heads x value width -> d_model (both attention kinds)
    width = out.in_features if isinstance(out, nn.Linear) else block.attn_norm.weight.numel()
    return 2.0 * active + 4.0 * seq_len * width / 2


def split_layers(costs: list[float], n_stages: int, head_cost: float = 0.0) -> list[int]:
    """Blocks per stage: contiguous, every stage non-empty, the most expensive stage as cheap as it
    can be (the last stage also pays `head_cost`). Ties go to the earlier cut."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n_stages} stages for {n} blocks")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the least max-cost of cutting the first i blocks into s stages; cut[s][i]: where
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n + 1):
            extra = head_cost if (s == n_stages and i == n) else 0.0
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    sizes, i = [], n
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def stage_sizes(spec: PipelineSpec, blocks: list[nn.Module], seq_len: int, head_params: int) -> list[int]:
    """The spec's explicit split, or one balanced by cost (module note)."""
    spec.check_model(len(blocks))
    if spec.layers:
        return list(spec.layers)
    return split_layers([block_cost(b, seq_len) for b in blocks], spec.num_stages, 2.0 * head_params)
