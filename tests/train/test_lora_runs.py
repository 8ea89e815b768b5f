"""A LoRA run as a user runs it: on a base named by path, checkpoints without the base, merge-lora,
the base's digest guarding resume and load, and the commands that refuse a LoRA run by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dropless.hf import merge_lora
from dropless.hf.load_run import load_model
from dropless.runs import checkpoint as ckpt
from dropless.runs.dcp_tensors import open_tensors
from dropless.serve import quantize
from dropless.train.loop import Trainer
from tests.tiny_run import tiny
from tests.tolerances import REFERENCE, assert_close

SHORT = ("train.steps=4", "train.ckpt_every=2", "train.eval_every=2")


def lora_run(tmp: Path, base: Path, *extra: str) -> Path:
    run = tmp / "lora"
    resume = ckpt.latest_checkpoint(run) is not None
    cfg = tiny(*SHORT, "train.lora.rank=4", "train.lora.alpha=8", "train.lr=3e-2", f"train.lora.base_from=run:{base}",
               'train.lora.targets=["attn","experts","router"]', *extra)
    Trainer(cfg, run, resume=resume).fit()
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("lora_runs")
    base = tmp / "base"
    Trainer(tiny(*SHORT), base).fit()
    return base, lora_run(tmp, base)


def test_checkpoint_holds_adapters_not_the_base(runs: tuple[Path, Path]) -> None:
    _, run = runs
    names = set(open_tensors(ckpt.latest_checkpoint(run)).specs)
    assert names and all(".lora_" in n or n.endswith(("router.weight", "router.expert_bias")) for n in names), names
    assert any(n.endswith("experts.lora_a1_EDr") for n in names)
    assert not any(n.endswith(("w_gate_up_EDF", "embed.weight", "attn.qkv.weight")) for n in names)


def test_adapted_model_differs_from_base_and_merge_computes_it(runs: tuple[Path, Path], tmp_path: Path) -> None:
    base, run = runs
    adapted, cfg = load_model(run)
    plain, _ = load_model(base)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    assert merge_lora.main([str(run), "--out", str(tmp_path / "merged")]) == 0
    merged, mcfg = load_model(tmp_path / "merged")
    assert mcfg.train.lora.rank == 0 and cfg.train.lora.rank == 4
    with torch.no_grad():
        a, b, p = adapted(tokens).logits, merged(tokens).logits, plain(tokens).logits
    assert not torch.equal(a, p)  # the adapters trained
    assert_close(b, a, REFERENCE[torch.float32])
    # the merged run is a full run: a second LoRA run can stand on it
    assert merge_lora.main([str(run), "--out", str(tmp_path / "merged")]) == 2  # --out not empty


def test_base_changed_since_training_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "base"
    Trainer(tiny(*SHORT), base).fit()
    run = lora_run(tmp_path, base, "train.steps=2")
    load_model(run)  # the base as trained on
    Trainer(tiny("train.steps=6", "train.ckpt_every=2", "train.eval_every=2"), base, resume=True).fit()
    with pytest.raises(ValueError, match="trained on base sha256:"):
        load_model(run)
    with pytest.raises(ValueError, match="trained on base sha256:"):
        lora_run(tmp_path, base, "train.steps=3")  # (lora_run resumes: the run folder exists)


def test_lora_run_as_base_and_quantize_are_refused(runs: tuple[Path, Path], tmp_path: Path) -> None:
    _, run = runs
    with pytest.raises(ValueError, match="is a LoRA run"):
        lora_run(tmp_path, run)
    with pytest.raises(ValueError, match=r"train\.lora\.rank=4"):
        quantize.quantize_run(run, "mxfp4", tmp_path / "q")
    assert not (tmp_path / "q").exists()
