"""This rank's part of a pipelined model as one module, under the whole model's names: what the trainer
holds instead of an `MoEModel` when `parallel.pp_size` > 1.

`embed` (first stage, and the last with tied embeddings or MTP), `blocks.<i>` for every block of this
rank's stages, `norm`, `head` and `mtp.<k>` (last stage): the same modules the stages run
(pipeline_stage.py), so the
optimizer, the state dicts and the checkpoints (runs/dist_checkpoint.py) see the names one process
sees, and a checkpoint written at one pipeline layout loads at another, or in one process.

Calling it runs the pipeline's forward (`Pipeline.forward_only`: evaluation and the routing probe);
training steps go through `Pipeline.step`. The routing record of a log interval is each rank's
own layers; `merge_records` gathers them over the pipeline, in the model's layer order, so the
logging rank's record and alarms cover every layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..expert_slots import ExpertSlots
from ..model import ModelOutput
from .pipeline import Pipeline


class PipelineModel(nn.Module):
    def __init__(self, pipeline: Pipeline, param_counts: dict[str, int]) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.cfg = pipeline.cfg
        self.lora = None
        self._counts = dict(param_counts)
        mods = pipeline.modules
        embed = next((m.embed for m in mods if m.embed is not None), None)
        if embed is not None:
            self.embed = embed
        self.blocks = nn.ModuleDict({n: b for m in sorted(mods, key=lambda m: m.index) for n, b in m.blocks.items()})
        last = next((m for m in mods if m.is_last), None)
        if last is not None:
            self.norm, self.head = last.norm, last.head
            if last.mtp is not None:
                self.mtp = last.mtp

    def moe_layers(self) -> list[nn.Module]:
        """This rank's MoE layers, in the model's order."""
        return [b.ffn for b in self.blocks.values() if b.is_moe]

    def moe_block_ids(self) -> list[int]:
        """The model's block index of each of `moe_layers()`."""
        return [int(n) for n, b in self.blocks.items() if b.is_moe]

    def mtp_moe_layers(self) -> list[nn.Module]:
        """The MTP modules' MoE blocks (on the last stage's rank; else none)."""
        return self.pipeline.mtp_moe_layers()

    def all_moe_layers(self) -> list[nn.Module]:
        """This rank's main MoE layers, then its MTP modules' (the balancing rules' order)."""
        return [*self.moe_layers(), *self.mtp_moe_layers()]

    def expert_slots(self) -> ExpertSlots:
        layers = self.moe_layers()
        return layers[0].slots if layers else ExpertSlots.from_config(self.cfg.moe)

    def num_params(self) -> dict[str, int]:
        """The whole model's counts (every stage), as one process reports them."""
        return dict(self._counts)

    def forward(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor | None = None,
                replay_ids: list[torch.Tensor] | None = None, *, segments_BS: torch.Tensor | None = None,
                **_: Any) -> ModelOutput:
        """The pipeline's forward (collective): the mean cross-entropy on every rank of the pipeline;
        no logits (they live on the last stage's rank), this rank's layers' MoE outputs."""
        if replay_ids is not None:
            raise ValueError("a pipelined model takes no routing replay (parallel.pp_size > 1)")
        ce, records = self.pipeline.forward_only(tokens_BS, targets_BS, segments_BS)
        moe = [m for r in (records[0] if records else []) for m in r.moe]
        zero = torch.zeros((), device=self.pipeline.device)
        return ModelOutput(None, ce, ce, zero, moe)


def merge_records(row: dict, block_ids: list[int], group: dist.ProcessGroup) -> dict:
    """The routing row of every rank of the pipeline as one, its layers in the model's order (every rank
    gets it: one object all-gather per log interval, host data only). `maxvio_worst_mean` (the mean
    over steps of the worst layer) cannot be recombined from per-stage means: the largest stage's is
    kept, a lower bound of the whole model's."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (block_ids, row), group=group)
    layers = sorted(((i, layer) for ids, r in parts for i, layer in zip(ids, r["layers"])), key=lambda t: t[0])
    worst = [r["maxvio_worst_mean"] for _, r in parts if r.get("maxvio_worst_mean") is not None]
    # the step's skipped and non-finite counts are the same on every rank with layers (all skip together)
    base = next((r for _, r in parts if r["layers"]), row)
    return {**base, "layers": [layer for _, layer in layers], "maxvio_worst_mean": max(worst) if worst else None}
