"""A fresh model's initial weights are a function of (seed, parameter name): the same bits at world
1, 2 and 4 and under every EP layout (distributed/materialize.py, layers/init.py). Each rank builds
the model on meta, parallelises it, materialises and fills only its own shards; the shards are
gathered here by their global rows and compared with the one-process model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dropless.config import apply_overrides, load_config
from dropless.distributed.materialize import build_model, local_rows
from dropless.distributed.mesh import build_meshes
from dropless.model import MoEModel
from dropless.runs import presets

from dist_harness import run_world

OVERRIDES = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.vocab_size=263",
             "model.moe.num_experts=8", "model.moe.d_expert=24", "model.moe.n_shared_experts=1",
             "model.n_dense_layers=1", "model.attn_bias=true"]
SEED = 1234


def _cfg(ep: int, tie: bool = False):
    return apply_overrides(load_config(presets.preset_path("tiny")),
                           [*OVERRIDES, f"parallel.ep_size={ep}", f"model.tie_embeddings={str(tie).lower()}"])


def _shards(rank: int, world: int, ep: int, tie: bool, out: str) -> None:
    cfg = _cfg(ep, tie)
    meshes = build_meshes(ep, "cpu")
    model, names, _ = build_model(cfg.model, torch.device("cpu"), SEED, meshes, cfg.parallel)
    where = local_rows(meshes, names)
    parts = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        r = where(name, p)
        parts[name] = (r.start, r.tensor.detach().clone())
    if tie:  # still one parameter after to_empty under FSDP2
        assert model.head.weight is model.embed.weight
    torch.save(parts, Path(out) / f"rank{rank}.pt")
    dist.barrier()


@pytest.mark.parametrize("world,ep,tie", [pytest.param(2, 2, False, marks=pytest.mark.slow), (4, 2, True),
                                         pytest.param(2, 1, True, marks=pytest.mark.slow),
                                         pytest.param(4, 4, False, marks=pytest.mark.slow)])
def test_initial_weights_are_the_same_at_every_layout(tmp_path: Path, world: int, ep: int, tie: bool) -> None:
    ref = MoEModel(_cfg(1, tie).model, seed=SEED)
    run_world(_shards, world, tmp_path, ep, tie, str(tmp_path))
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    covered = 0
    for name, full in ref.named_parameters():
        rows = torch.zeros(full.shape[0] if full.dim() else 1, dtype=torch.int32)
        for part in parts:
            start, t = part[name]
            n = t.shape[0] if t.dim() else 1
            assert torch.equal(t, full[start:start + n]), (name, start)
            rows[start:start + n] += 1
        # experts: ep slices x edp chunks; dense: dp chunks; every row held once per replica
        assert rows.min() >= 1, name
        covered += 1
    assert covered == len(list(ref.parameters()))


def test_meta_build_is_the_cpu_build() -> None:
    cfg = _cfg(1).model
    built = MoEModel(cfg, seed=SEED)
    model, _, counts = build_model(cfg, torch.device("cpu"), SEED)
    assert counts == built.num_params()
    for (n, a), (m, b) in zip(built.state_dict().items(), model.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n
