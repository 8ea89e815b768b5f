"""`--init-from hf:DIR` at world 2 and 4: each rank reads only the slices of its own shards from the
safetensors files (hf/shard_load.py) into the model built on meta and parallelised (EP, FSDP2); the
shards put together are bitwise the one-process import, and the sharded model's logits are
transformers' on the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dropless.config import load_config
from dropless.distributed import parallelize as par
from dropless.distributed.materialize import local_rows
from dropless.hf import import_hf
from dropless.runs import presets
from dropless.train.layout import build_layout, place_model

from dist_harness import run_world

pytest.importorskip("transformers")
from hf_models import deepseek_config, qwen3_config, save_hf  # noqa: E402
from tolerances import REFERENCE, assert_close  # noqa: E402

TOKENS = torch.tensor([[5, 17, 200, 3, 99, 41, 7, 250], [1, 2, 3, 4, 5, 6, 7, 8]])


def _rank(rank: int, world: int, hf_dir: str, ep: int, out: str) -> None:
    cfg = import_hf.init_config(Path(hf_dir), load_config(presets.preset_path("tiny")),
                                [f"parallel.ep_size={ep}", "train.device=cpu"])
    loader = import_hf.weight_loader(hf_dir)
    layout, model = place_model(cfg, build_layout(cfg), loader)
    where = local_rows(layout.meshes, layout.expert_names)
    parts = {n: (r.start, r.tensor.detach().clone()) for n, p in
             [*model.named_parameters(), *model.named_buffers()] if (r := where(n, p)) is not None}
    model.eval()
    with torch.no_grad(), par.exact_dispatch(model):
        logits = model(TOKENS).logits
    torch.save({"parts": parts, "logits": logits, "bytes_read": loader.bytes_read}, Path(out) / f"rank{rank}.pt")
    dist.barrier()


@pytest.mark.parametrize("family,world,ep", [("qwen3_moe", 4, 2), pytest.param("deepseek_v3", 4, 4, marks=pytest.mark.slow),
                                             pytest.param("qwen3_moe", 2, 2, marks=pytest.mark.slow)])
def test_sharded_import_is_the_whole_import(tmp_path: Path, family: str, world: int, ep: int) -> None:
    hf_dir = tmp_path / "hf"
    config = (qwen3_config(num_experts=8) if family == "qwen3_moe" else deepseek_config())
    hf = save_hf(config, hf_dir)
    whole, _ = import_hf.load_model(hf_dir)
    run_world(_rank, world, tmp_path, str(hf_dir), ep, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    tensors = {**dict(whole.named_parameters()), **dict(whole.named_buffers(remove_duplicate=False))}
    for name, full in tensors.items():
        if name.startswith("rope_"):
            continue
        seen = torch.zeros(full.shape[0], dtype=torch.int32)
        for r in ranks:
            start, t = r["parts"][name]
            assert torch.equal(t, full[start:start + t.shape[0]]), (name, start)
            seen[start:start + t.shape[0]] += 1
        assert seen.min() >= 1, name
    # every rank read part of the files, none all of them
    total = sum(p.numel() * p.element_size() for p in hf.state_dict().values())
    assert all(0 < r["bytes_read"] < total for r in ranks)
    with torch.no_grad():
        expected = hf(TOKENS).logits
    for r in ranks:
        assert_close(r["logits"], expected, REFERENCE[torch.float32], f"{family} at world {world}, ep {ep}")


@pytest.mark.slow
def test_import_hf_at_world_2_is_the_one_process_import(tmp_path: Path) -> None:
    """`dropless import-hf --nproc 2 --set parallel.ep_size=2`: every rank reads its shards and the
    step-0 checkpoint is written collectively; it loads as the one-process import does."""
    from dropless.cli import main as cli
    from dropless.runs.load import load_model

    hf_dir = tmp_path / "hf"
    save_hf(qwen3_config(num_experts=8), hf_dir)
    assert cli(["import-hf", str(hf_dir), "--out", str(tmp_path / "one"), "--no-progress"]) == 0
    assert cli(["import-hf", str(hf_dir), "--out", str(tmp_path / "two"), "--no-progress", "--nproc", "2",
                "--set", "parallel.ep_size=2"]) == 0
    one, _ = load_model(tmp_path / "one")
    two, cfg = load_model(tmp_path / "two")
    assert cfg.parallel.ep_size == 2
    for (n, a), (m, b) in zip(one.state_dict().items(), two.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n
    assert not list(tmp_path.glob(".two*"))  # nothing hidden left behind
    # refused before any process starts: the EP size must divide the processes
    assert cli(["import-hf", str(hf_dir), "--out", str(tmp_path / "three"), "--no-progress", "--nproc", "3",
                "--set", "parallel.ep_size=2"]) == 2
    assert not (tmp_path / "three").exists()
