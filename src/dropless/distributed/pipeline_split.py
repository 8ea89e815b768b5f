"""Where a pipeline's stages begin and end, and which rank runs which stage.

A `PipelineSpec` (pipeline_config.py) is the pipeline's shape: `pp_size` ranks in a pipeline,
`stages_per_rank` model chunks on each, `microbatches` per schedule call, and an optional explicit
split (`layers`: how many blocks each stage holds, in order).

The split. Without an explicit list, the blocks are cut into contiguous stages that minimise the
most expensive stage (an exact linear-partition dynamic programme: n_layers x stages is tiny). A
stage's cost is the sum of its blocks' per-token forward FLOPs, read from the built modules (on
meta: nothing is allocated), plus on the last stage the LM head's and the multi-token prediction
modules' (layers/mtp.py; each: its block, its [2D -> D] projection and the shared head once more):
2 x active parameters for each matmul, and the attention's score and value products, 4 x seq_len x
the query width, averaged over causal positions (half). The embedding is a lookup: no FLOPs. (An
MTP module runs on S - k positions; its cost per token of the batch is counted as if on all S, an
upper bound off by k / S.)

Which rank runs which stage: `PipelineSpec.stages_of` (pipeline_config.py).
"""

from __future__ import annotations

from torch import nn

from ..pipeline_config import PipelineSpec


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


def tail_cost(head_params: int, mtp: list[nn.Module], seq_len: int) -> float:
    """Per-token forward FLOPs the last stage adds after its blocks: the LM head, and each MTP module
    (`layers.mtp.MTPModule`: its block, its projection, the head again; module note)."""
    cost = 2.0 * head_params
    for module in mtp:
        cost += block_cost(module.block, seq_len) + 2.0 * module.proj.weight.numel() + 2.0 * head_params
    return cost


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


def stage_sizes(spec: PipelineSpec, blocks: list[nn.Module], seq_len: int, head_params: int,
                mtp: list[nn.Module] | None = None) -> list[int]:
    """The spec's explicit split, or one balanced by cost (module note); `mtp`: the model's MTP
    modules, on the last stage."""
    spec.check_model(len(blocks))
    if spec.layers:
        return list(spec.layers)
    return split_layers([block_cost(b, seq_len) for b in blocks], spec.num_stages,
                        tail_cost(head_params, mtp or [], seq_len))


def model_stage_sizes(spec: PipelineSpec, model: nn.Module, seq_len: int) -> list[int]:
    """`stage_sizes` of an `MoEModel` (built on meta or materialised): its blocks, its head and its
    MTP modules. The trainer's pipeline and the planner both split by it."""
    return stage_sizes(spec, list(model.blocks), seq_len, model.head.weight.numel(), list(model.mtp))
