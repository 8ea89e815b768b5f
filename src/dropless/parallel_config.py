"""The parallel part of the config tree (`parallel.*`): expert parallelism and its buffers, overflow
policy, hot-expert replication, overlap and collective checks (docs/ep.md); pipeline stages
(`parallel.pp_*`, pipeline_config.py, docs/parallelism.md). Re-exported by config.py,
where the rest of the tree lives; split out only to keep that file one screenful of concerns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Union  # noqa: F401  (field annotations)

from .configtree import _choice, _fail, _positive  # noqa: F401
from .ops import payload
from .moe_config import MoEConfig  # noqa: F401
from .pipeline_config import SCHEDULES, PipelineSpec


EP_MODES = ("exact", "buffered")
ON_OVERFLOW = ("skip", "retry", "spill")  # buffered EP: what happens to pairs that did not fit
EP_DISPATCH = ("all_to_all", "ring", "auto")  # parallel.ep_dispatch


@dataclass
class ParallelConfig:
    """Expert parallelism (mission.md section 5; protocol in docs/ep_dispatch.md)."""

    ep_size: int = 1  # ranks the experts are spread over (contiguously: rank r owns a block of E/ep_size)
    ep_mode: str = "exact"  # "exact": split sizes read on the host; "buffered": fixed buffers, no sync
    dedup: bool = True  # a token crosses once per destination rank, however many of its experts live there
    # buffered mode: per-link buffer = factor x the pairs perfectly balanced routing sends over one link,
    # capped at the worst case; -1 = the worst case (never overflows); "auto": sized per layer from the
    # link demand seen at the checks (train/ep_buffers.py). Declared str first so that an override
    # "auto" parses; numbers are stored as float.
    ragged_buffer_factor: str | float = 2.0
    overflow_check_every: int = 20  # buffered mode: steps between host checks of the overflow counter
    # buffered mode, older switch: true = on_overflow "retry", false = "skip"; on_overflow wins when set
    retry_on_overflow: bool = True
    # buffered mode: "skip" the step, "retry" it with worst-case buffers, "spill" the pairs that did not
    # fit into a second exact-size exchange in the same layer call (with ep_capturable: a second
    # fixed-size one, run when some rank overflowed, decided on the device); "" = from retry_on_overflow
    on_overflow: str = ""
    # buffered mode: the most tokens one rank holds in a micro-batch, the bound every rank sizes its
    # fixed all-to-all buffers from (ranks may hold fewer; more is a ValueError from the shape).
    # 0 = the trainer's micro-batch, train.batch_size * train.seq_len
    max_tokens_per_rank: int = 0
    # watching the collectives (distributed/watch.py, docs/ep_health.md "All-to-all health", "Hang diagnostics")
    check_collectives: bool = False  # fingerprint every watched collective; ranks compare them at log steps
    collective_timeout_s: float = 0.0  # > 0: a collective fails after this long, naming the ranks missing
    a2a_alarm_ratio: float = 1.5  # health alarm when an interval's all-to-all time exceeds this x baseline
    # EP with shared experts: compute them while the dispatch all-to-all is in flight (docs/ep_health.md "Overlap")
    overlap_shared: bool = True
    # the token rows' encoding in the dispatch all-to-all (ops/payload.py, docs/ep_wire.md "Low-precision payload"):
    # "native" (the rows' dtype), "bf16", "mxfp8", "fp8_blockwise"; gradients then travel back in bf16.
    # One process rounds the rows the same way, so every EP size trains the same numbers
    dispatch_dtype: str = "native"
    # how the rows reach the experts: "all_to_all" (to the ranks that hold them), "ring" (every rank
    # gathers every token, a reduce-scatter sums the results back), "auto" (the ring where it sends
    # fewer bytes); docs/ep_wire.md
    ep_dispatch: str = "all_to_all"
    # an EP group over several nodes: "node" sends a token across nodes once per destination node and
    # fans it out inside the node (ep_hier.py; buffered mode: ep_hier_buffered.py); ep_node_size: EP
    # ranks per node (0 = the launcher's LOCAL_WORLD_SIZE)
    ep_hierarchy: str = "flat"
    ep_node_size: int = 0
    # buffered EP on torch's functional collectives: an MoE layer's forward and backward trace into
    # one graph with no host read (what CUDA-graph capture needs; docs/ep_wire.md "Capturable")
    ep_capturable: bool = False
    # false: no FSDP2; every rank holds the whole dense model and its EP slice of the experts, and
    # the trainer all-reduces the gradients (distributed/replicated.py). FSDP2's hooks cannot be
    # traced, so this is the layout under which the whole step compiles across processes
    # (train.compile=step); it costs the dense weights' and their optimizer state's memory per rank
    fsdp: bool = True
    # hot-expert replication (train/ep_replicas_train.py): copies of the R busiest experts on other EP
    # ranks, placed from the global counts every replica_interval steps; 0 = off
    replicate_hot_experts: int = 0
    replica_interval: int = 100
    # pipeline stages (distributed/pipeline.py, docs/parallelism.md): pp_size ranks per pipeline, each
    # running pp_stages_per_rank stages (2+ for interleaved_1f1b and zbv); every micro-batch of
    # train.batch_size rows is cut into pp_microbatches (0 = pp_size: enough to fill the pipeline);
    # pp_layers: blocks per stage, in order ([] = balanced by each block's FLOPs)
    pp_size: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 1
    pp_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate("parallel")

    def validate(self, prefix: str = "parallel") -> None:
        _positive(f"{prefix}.ep_size", self.ep_size)
        _choice(f"{prefix}.ep_mode", self.ep_mode, EP_MODES)
        _choice(f"{prefix}.dispatch_dtype", self.dispatch_dtype, payload.PAYLOADS)
        _choice(f"{prefix}.ep_dispatch", self.ep_dispatch, EP_DISPATCH)
        _choice(f"{prefix}.ep_hierarchy", self.ep_hierarchy, ("flat", "node"))
        if not isinstance(self.fsdp, bool):
            _fail(f"{prefix}.fsdp", self.fsdp, "must be true or false")
        if not self.fsdp and self.pp_size > 1:
            _fail(f"{prefix}.fsdp", False, f"with parallel.pp_size={self.pp_size}: pipeline stages shard "
                  "their blocks with FSDP2 (distributed/pipeline.py); leave parallel.fsdp=true")
        if not isinstance(self.ep_capturable, bool):
            _fail(f"{prefix}.ep_capturable", self.ep_capturable, "must be true or false")
        if self.ep_capturable:
            P = prefix
            why = [f"{P}.ep_mode={self.ep_mode!r}" if self.ep_mode != "buffered" else "",
                   f"{P}.dispatch_dtype={self.dispatch_dtype!r}" if self.dispatch_dtype != "native" else "",
                   f"{P}.ep_dispatch={self.ep_dispatch!r}" if self.ep_dispatch != "all_to_all" else "",
                   f"{P}.ep_hierarchy='node'" if self.ep_hierarchy != "flat" else "",
                   f"{P}.check_collectives=true" if self.check_collectives else "",
                   f"{P}.replicate_hot_experts={self.replicate_hot_experts}" if self.replicate_hot_experts else ""]
            if any(why):
                _fail(f"{prefix}.ep_capturable", True, "needs buffered mode, the native payload, the flat "
                      "all-to-all, no collective checks and no replicas; got "
                      + ", ".join(w for w in why if w))
        g = self.ep_node_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            _fail(f"{prefix}.ep_node_size", g, "must be an int >= 0 (0 = LOCAL_WORLD_SIZE)")
        if self.ep_hierarchy == "node":
            if g and self.ep_size % g:
                _fail(f"{prefix}.ep_node_size", g, f"must divide parallel.ep_size={self.ep_size}")
            if self.ep_mode == "buffered" and self.ragged_buffer_factor == "auto":
                _fail(f"{prefix}.ep_hierarchy", "node", f"with {prefix}.ragged_buffer_factor='auto': the adaptive "
                      "controller sizes one link per layer, buffered two-level dispatch has two levels to size "
                      "(distributed/ep_hier_buffered.py); use a number or -1")
            why = [f"{prefix}.ep_dispatch={self.ep_dispatch!r}" if self.ep_dispatch != "all_to_all" else "",
                   f"{prefix}.replicate_hot_experts={self.replicate_hot_experts}" if self.replicate_hot_experts else "",
                   f"{prefix}.pp_size={self.pp_size}" if self.pp_size > 1 else ""]
            if any(why):
                _fail(f"{prefix}.ep_hierarchy", "node", "goes with ep_dispatch 'all_to_all', no hot-expert "
                      "replicas and no pipeline stages; got " + ", ".join(w for w in why if w))
        if not isinstance(self.dedup, bool):
            _fail(f"{prefix}.dedup", self.dedup, "must be true or false")
        factor = self.ragged_buffer_factor
        if isinstance(factor, str) and factor != "auto":
            try:
                factor = self.ragged_buffer_factor = float(factor)
            except ValueError:
                _fail(f"{prefix}.ragged_buffer_factor", factor, "must be > 0, -1 for the worst case, or 'auto'")
        if factor != "auto" and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                 or not (factor == -1 or factor > 0)):
            _fail(f"{prefix}.ragged_buffer_factor", factor, "must be > 0, -1 for the worst case, or 'auto'")
        if self.on_overflow:
            _choice(f"{prefix}.on_overflow", self.on_overflow, ON_OVERFLOW)
        _positive(f"{prefix}.overflow_check_every", self.overflow_check_every)
        if not isinstance(self.retry_on_overflow, bool):
            _fail(f"{prefix}.retry_on_overflow", self.retry_on_overflow, "must be true or false")
        if isinstance(self.max_tokens_per_rank, bool) or not isinstance(self.max_tokens_per_rank, int) \
                or self.max_tokens_per_rank < 0:
            _fail(f"{prefix}.max_tokens_per_rank", self.max_tokens_per_rank,
                  "must be an int >= 0 (0 = the micro-batch)")
        if not isinstance(self.check_collectives, bool):
            _fail(f"{prefix}.check_collectives", self.check_collectives, "must be true or false")
        t = self.collective_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            _fail(f"{prefix}.collective_timeout_s", t, "must be >= 0 seconds (0 = the backend's default)")
        if not isinstance(self.overlap_shared, bool):
            _fail(f"{prefix}.overlap_shared", self.overlap_shared, "must be true or false")
        n = self.replicate_hot_experts
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            _fail(f"{prefix}.replicate_hot_experts", n, "must be an int >= 0 (0 = off)")
        _positive(f"{prefix}.replica_interval", self.replica_interval)
        if self.ep_dispatch != "all_to_all":
            if self.ep_mode == "buffered" and self.overflow_policy == "spill":
                _fail(f"{prefix}.ep_dispatch", self.ep_dispatch, "with on_overflow 'spill': the spill trip is "
                      "the all-to-all's; use parallel.on_overflow=skip or retry")
            if n:
                _fail(f"{prefix}.ep_dispatch", self.ep_dispatch, f"with replicate_hot_experts={n}: the ring "
                      "sends every token to every rank already; replicas are for the all-to-all")
        r = self.a2a_alarm_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 1:
            _fail(f"{prefix}.a2a_alarm_ratio", r, "must be > 1 (the all-to-all time over its baseline)")
        if isinstance(self.pp_microbatches, bool) or not isinstance(self.pp_microbatches, int) \
                or self.pp_microbatches < 0:
            _fail(f"{prefix}.pp_microbatches", self.pp_microbatches, "must be an int >= 0 (0 = pp_size)")
        if not isinstance(self.pp_layers, list):
            _fail(f"{prefix}.pp_layers", self.pp_layers, "must be a list of blocks per stage ([] = balanced)")
        if self.pp_size != 1:  # (at 1 the other pp fields are unused: a pipelined run resumed in one process)
            self.pipeline  # noqa: B018  (the spec's own checks)
        else:
            _choice(f"{prefix}.pp_schedule", self.pp_schedule, SCHEDULES)

    @property
    def hier_node_size(self) -> int | None:
        """`ep_node_size` when the two-level dispatch is on (0: the launcher's), else None: what
        distributed/mesh.py `build_meshes` takes."""
        return self.ep_node_size if self.ep_hierarchy == "node" else None

    @property
    def pipeline(self) -> PipelineSpec:
        """The pipeline's checked shape (pipeline_config.py); pp_size 1 is no pipeline."""
        return PipelineSpec(self.pp_size, self.pp_schedule, self.pp_microbatches or self.pp_size,
                            self.pp_stages_per_rank, tuple(self.pp_layers))

    def check_experts(self, num_experts: int, prefix: str = "parallel") -> None:
        """E experts must split evenly over ep_size ranks."""
        if num_experts % self.ep_size:
            _fail(f"{prefix}.ep_size", self.ep_size, f"does not divide model.moe.num_experts={num_experts}")

    def check_run(self, moe: MoEConfig, tokens: int, optimizer: str) -> None:
        """The combinations with the model and the trainer (`tokens` = train.batch_size *
        train.seq_len, `optimizer` = train.optimizer) that would otherwise fail at the first forward
        (or when the trainer starts), refused at validation."""
        self.check_experts(moe.num_experts)
        if self.ep_size > 1 and moe.capacity_factor is not None:
            _fail("parallel.ep_size", self.ep_size, f"with model.moe.capacity_factor={moe.capacity_factor}: "
                  "expert parallelism is dropless; the capacity baseline is single-device only")
        if self.replicate_hot_experts and self.ep_size < 2:
            _fail("parallel.replicate_hot_experts", self.replicate_hot_experts,
                  f"with parallel.ep_size={self.ep_size}: replicas live on other EP ranks (ep_size >= 2)")
        if self.replicate_hot_experts > moe.num_experts:
            _fail("parallel.replicate_hot_experts", self.replicate_hot_experts,
                  f"is more than model.moe.num_experts={moe.num_experts}")
        if self.ep_mode == "buffered" and 0 < self.max_tokens_per_rank < tokens:
            _fail("parallel.max_tokens_per_rank", self.max_tokens_per_rank,
                  f"is below a micro-batch, train.batch_size * train.seq_len = {tokens}: every step would "
                  "overrun the buffered EP bound (0 = the micro-batch)")
        if self.ep_mode == "buffered" and optimizer not in ("adamw", "muon"):
            _fail("parallel.ep_mode", self.ep_mode, f"with train.optimizer={optimizer!r}: the buffered "
                  "overflow guard skips a step on the device through eagerly created optimizer state "
                  "(fused AdamW's, or Muon's); use train.optimizer='adamw' or 'muon', or "
                  "parallel.ep_mode='exact'")

    @property
    def overflow_policy(self) -> str:
        """on_overflow when set, else the older retry_on_overflow switch (configs that predate it)."""
        return self.on_overflow or ("retry" if self.retry_on_overflow else "skip")

    def with_token_bound(self, tokens_per_micro_batch: int) -> ParallelConfig:
        """A copy with max_tokens_per_rank filled in (0 -> the trainer's micro-batch tokens)."""
        return replace(self, max_tokens_per_rank=self.max_tokens_per_rank or tokens_per_micro_batch)
