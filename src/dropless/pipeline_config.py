"""The pipeline part of the parallel config (`parallel.pp_*`): how many stages, which schedule, how many
micro-batches, and an optional explicit split. `PipelineSpec` is the checked shape the pipeline is
built from (distributed/pipeline_split.py, distributed/pipeline.py); `ParallelConfig.pipeline` makes
it from the config fields. Its checks are the `ValueError`s a user meets before any process starts
work, naming the `parallel.pp_*` field.

Placement of the S = pp_size x stages_per_rank stages on pp ranks:
- "loop" (gpipe, 1f1b, interleaved_1f1b, zero_bubble): rank r runs stages r, r + pp, r + 2 pp, ...
- "v" (zbv): two stages per rank, rank r runs r and 2 pp - 1 - r, so the first and last stages meet
  on rank 0 (the schedule's V shape).
"""

from __future__ import annotations

from dataclasses import dataclass

from .configtree import _fail

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
MULTI = ("interleaved_1f1b", "zero_bubble", "zbv")  # schedules that take a list of stages per rank


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
        """The batch's micro-batches: they divide it, and are enough for the schedule."""
        if batch_size % self.microbatches:
            _fail("parallel.pp_microbatches", self.microbatches, f"does not divide train.batch_size={batch_size}")
        if self.schedule == "1f1b" and self.microbatches < self.pp_size:  # torch's Schedule1F1B refuses it
            _fail("parallel.pp_microbatches", self.microbatches, f"with parallel.pp_schedule='1f1b' and "
                  f"pp_size={self.pp_size}: 1F1B needs at least pp_size micro-batches (gpipe takes fewer)")

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stage indices rank `pp_rank` of the pipeline runs, in its order (module note)."""
        if self.schedule == "zbv":
            return [pp_rank, 2 * self.pp_size - 1 - pp_rank]
        return [pp_rank + v * self.pp_size for v in range(self.stages_per_rank)]


def check_stage_model(spec: PipelineSpec, model) -> None:  # noqa: ANN001  (ModelConfig: config.py imports this)
    """The model under stages: enough blocks (every model knob runs under stages: the token ids that
    hash routing and multi-token prediction read travel with the activations)."""
    spec.check_model(model.n_layers)


def check_pipeline_run(cfg) -> None:  # noqa: ANN001  (RunConfig: config.py imports this)
    """A run with pipeline stages (parallel.pp_size > 1): the model and the batch fit the spec, and
    the trainer features that do not run under stages yet are refused by name, before anything
    starts (docs/parallelism.md, "Limits")."""
    p = cfg.parallel
    if p.pp_size == 1:
        return
    spec = p.pipeline
    check_stage_model(spec, cfg.model)
    spec.check_batch(cfg.train.batch_size)
    why = f"with parallel.pp_size={p.pp_size}: not under pipeline stages yet"
    if p.replicate_hot_experts:
        _fail("parallel.replicate_hot_experts", p.replicate_hot_experts, why)
    if p.ep_mode == "buffered":
        _fail("parallel.ep_mode", p.ep_mode, f"{why} (use parallel.ep_mode='exact')")
    if cfg.train.compile != "off":
        _fail("train.compile", cfg.train.compile, why)
    if cfg.train.lora.enabled:
        _fail("train.lora.rank", cfg.train.lora.rank, f"{why} (LoRA)")
    if cfg.data.replay_routing:
        _fail("data.replay_routing", cfg.data.replay_routing, why)
