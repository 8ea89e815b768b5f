"""A bf16 frozen base (train.lora.base, layers/frozen_base.py) under EP 2 and FSDP2 on two gloo
processes: narrowed on the meta device before the wrap, filled per shard, it computes the logits
of the one-process model bit for bit and runs its backward (FSDP2 asks one dtype of the trainable
parameters only); packing the experts there is refused naming the field (they are DTensors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dropless.config import load_config
from dropless.distributed.materialize import local_rows
from dropless.distributed.mesh import build_meshes
from dropless.distributed.parallelize import parallelize_model
from dropless.layers import frozen_base
from dropless.model import MoEModel
from dropless.runs.presets import preset_path

from dist_harness import run_world

# the experts are not a target: the adapters on them are not EP-sliced yet (distributed/parallelize_ep.py)
OVERRIDES = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.moe.num_experts=4",
             "model.moe.d_expert=32", "model.d_ff_dense=64", "model.moe.n_shared_experts=1",
             "model.max_seq_len=16", "train.seq_len=16", "train.batch_size=2", "train.lora.rank=4",
             'train.lora.targets=["attn","shared"]', "train.lora.base=bf16", "parallel.ep_size=2",
             "train.optimizer=adamw"]


def _worker(rank: int, world: int) -> None:
    cfg = load_config(preset_path("tiny"), OVERRIDES)
    meshes = build_meshes(2, "cpu")
    with torch.device("meta"):
        model = MoEModel(cfg.model, lora=cfg.train.lora)
    names = parallelize_model(model, meshes, cfg.parallel)
    model.materialize(torch.device("cpu"))
    with torch.no_grad():
        model.init_weights(0, local_rows(meshes, names))
    one = MoEModel(cfg.model, seed=0, lora=cfg.train.lora)
    tok = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    out = model(tok, tok)
    assert torch.equal(out.logits, one(tok, tok).logits)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="train.lora.base='mxfp4' packs the routed experts in one process"):
        frozen_base.pack_frozen_base(model, "mxfp4")


@pytest.mark.slow
def test_bf16_base_under_ep_and_fsdp(tmp_path: Path) -> None:
    run_world(_worker, 2, tmp_path)
