"""export-hf streams from the checkpoint (hf/export_hf.py, runs/dcp_tensors.py): a checkpoint written by
2 gloo processes with expert parallelism 2 (each rank's file holds half the experts) exports, in this
one process and without a process group, to the same bytes as the same weights saved by one process
and as an older one-process `state.pt`; transformers loads it and computes dropless's logits. The
reader never holds two parameters at once, each shard reads each parameter at most once, and the
shards keep to --max-shard-size-mb. bf16 exports are the fp32 ones rounded. A checkpoint that
disagrees with the run's config is refused by tensor name before anything is written."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch

from dist_harness import run_world
from hf_models import transformers
from tiny_run import tiny
from tolerances import REFERENCE, assert_close

from dropless.cli import main as cli
from dropless.config import from_dict, RunConfig
from dropless.hf import export_hf, import_hf, mapping
from dropless.runs import checkpoint as ckpt
from dropless.runs import dcp_tensors, dist_checkpoint
from dropless.runs.load import load_model

pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

# qwen3_moe-expressible (q/k norm, a dense first layer, untied head: lm_head is written); 2 steps at fp32
RUN = ("model.qk_norm=true", "model.tie_embeddings=false", "train.steps=2", "train.ckpt_every=2",
       "train.eval_every=2", "train.eval_batches=1", "train.dtype=fp32")
EXPERTS = "blocks.1.ffn.experts.w_gate_up_EDF"
SHARD_MB = 0.01  # ~10 kB: many shards, some tensors larger than a shard (a shard of their own)


def _train_ep2(rank: int, world: int, run_dir: Path) -> None:
    from dropless.train.loop import Trainer

    Trainer(tiny(*RUN, "parallel.ep_size=2"), run_dir).fit()


def _one_process_copies(src: Path, dcp_run: Path, pt_run: Path) -> None:
    """The weights of `src`'s checkpoint saved again by one process: DCP, and an older `state.pt`."""
    path = ckpt.latest_checkpoint(src)
    state = dist_checkpoint.trainer_state(path)
    model, _ = load_model(src)
    dist_checkpoint.save(dcp_run, state["step"], model, None, state)
    ckpt.save_checkpoint(pt_run, state["step"], {**state, "model": model.state_dict()})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("runs")
    run_world(_train_ep2, 2, d, d / "ep2")
    _one_process_copies(d / "ep2", d / "one", d / "pt")
    return {"ep2": d / "ep2", "one": d / "one", "pt": d / "pt"}


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in import_hf.shard_files(folder) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_ep2_checkpoint_exports_the_same_bytes_as_one_process(runs: dict[str, Path], tmp_path: Path) -> None:
    path = ckpt.latest_checkpoint(runs["ep2"])
    md = dcp_tensors.dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert len(md["model." + EXPERTS].chunks) == 2  # each rank wrote its half of the experts
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    outs = {k: tmp_path / k for k in runs}
    for k, run in runs.items():
        export_hf.export(run, outs[k], "qwen3_moe", max_shard_mb=SHARD_MB)
    assert not torch.distributed.is_initialized()
    ref = files(outs["ep2"])
    assert len([n for n in ref if n.endswith(".safetensors")]) > 3
    for k in ("one", "pt"):
        assert files(outs[k]) == ref, k  # every shard, the index and config.json, byte for byte
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(outs["ep2"], output_loading_info=True,
                                                                 dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model, _ = load_model(runs["ep2"])
    x = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(hf.eval()(x).logits, model(x).logits, REFERENCE[torch.float32], "exported from EP 2")


@pytest.mark.slow
@pytest.mark.parametrize("shard_mb", [SHARD_MB, 0.05])  # 2-3 expert slots a shard; a dozen
def test_reads_one_parameter_at_a_time_and_keeps_the_shard_size(runs: dict[str, Path], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                shard_mb: float) -> None:
    """Every tensor the reader handed out is tracked: when the next is read, none of the earlier ones
    may still be alive (so at most one parameter is held, whatever the shards hold), and a shard reads
    each parameter at most once (the slots of one parameter are consecutive)."""
    real_read = dcp_tensors.DCPTensors.read
    handed: list[weakref.ref] = []
    reads: list[str] = []
    peak = {"live": 0, "bytes": 0}

    def read(self: dcp_tensors.DCPTensors, name: str) -> torch.Tensor:
        live = [t for t in (r() for r in handed) if t is not None]
        t = real_read(self, name)
        peak["live"] = max(peak["live"], len(live) + 1)
        peak["bytes"] = max(peak["bytes"], sum(u.nbytes for u in live) + t.nbytes)
        handed.append(weakref.ref(t))
        reads.append(name)
        return t

    monkeypatch.setattr(dcp_tensors.DCPTensors, "read", read)
    out = tmp_path / "out"
    assert cli(["export-hf", str(runs["ep2"]), "--out", str(out), "--family", "qwen3_moe",
                "--max-shard-size-mb", str(shard_mb), "--no-progress"]) == 0
    cfg = from_dict(RunConfig, dist_checkpoint.trainer_state(ckpt.latest_checkpoint(runs["ep2"]))["config"])
    meta = mapping.meta_model(cfg.model)
    table = {s.hf_name: s for s in mapping.slots(meta, "qwen3_moe")}
    sizes = {n: p.numel() * 4 for n, p in meta.state_dict().items()}
    assert peak["live"] == 1 and peak["bytes"] == max(sizes[p] for p in reads)
    weight_map = json.loads((out / import_hf.INDEX_FILE).read_text())["weight_map"]
    shards_of: dict[str, set[str]] = {}
    for hf_name, filename in weight_map.items():
        shards_of.setdefault(table[hf_name].param, set()).add(filename)
    assert set(reads) == set(shards_of)
    for param, shards in shards_of.items():
        assert reads.count(param) <= len(shards), (param, reads.count(param), len(shards))
    assert reads.count(EXPERTS) == 1  # its 8 slots straddle shards: the parameter stays cached
    limit = int(shard_mb * 2**20)
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(f)
        total = sum(t.nbytes for t in tensors.values())
        assert total <= limit or len(tensors) == 1, (f.name, total, limit)


@pytest.mark.slow
def test_bf16_export_is_the_fp32_export_rounded(runs: dict[str, Path], tmp_path: Path) -> None:
    export_hf.export(runs["ep2"], tmp_path / "fp32", "qwen3_moe", max_shard_mb=SHARD_MB)
    export_hf.export(runs["ep2"], tmp_path / "bf16", "qwen3_moe", dtype="bf16", max_shard_mb=SHARD_MB)
    a, b = hf_tensors(tmp_path / "fp32"), hf_tensors(tmp_path / "bf16")
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert b[k].dtype == torch.bfloat16 and torch.equal(b[k], v.to(torch.bfloat16)), k
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    # transformers, upcasting the bf16 weights, computes dropless's model with its weights rounded
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", output_loading_info=True,
                                                                 dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model, _ = load_model(runs["ep2"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        x = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))
        assert_close(hf.eval()(x).logits, model(x).logits, REFERENCE[torch.float32], "bf16 export")


@pytest.mark.slow
def test_checkpoint_that_disagrees_with_the_config_is_refused_by_name(runs: dict[str, Path], tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The run's config says 8 experts of width 32; the checkpoint holds 4 (trainer.pt edited)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["one"], run)
    path = ckpt.latest_checkpoint(run)
    state = dist_checkpoint.trainer_state(path)
    state["config"]["model"]["moe"]["num_experts"] = 8
    torch.save(state, path / dist_checkpoint.TRAINER_FILE)
    assert cli(["export-hf", str(run), "--out", str(tmp_path / "out"), "--family", "qwen3_moe", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "tensor model.blocks.1.ffn.router.weight is stored as [4, 32] torch.float32; the run's model has " \
           "[8, 32] torch.float32" in err, err
    assert not any(p.name.startswith("out") or p.name.startswith(".out.") for p in tmp_path.iterdir())
