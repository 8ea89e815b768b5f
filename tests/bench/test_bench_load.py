"""`dropless bench load` (bench/load.py, bench/load_memory.py) and the checkpoint maker
(bench/hf_shapes.py).

The load bench runs on the tiny Qwen3 checkpoint of tests/hf_models.py (sharded, fp32; 4 experts). Its memory
figures are too small there for the checks to mean anything (torch's first-op setup alone is MiBs),
so the tests hold the numbers to what they are defined as, not to PASS: the final bytes are the
model's local storages, peak >= baseline, the limits follow the stated rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_models import qwen3_config, save_hf  # skips without transformers, safetensors, tokenizers

from dropless.bench import hf_shapes, load, load_memory
from dropless.cli import main as cli_main
from dropless.hf import import_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    save_hf(qwen3_config(num_experts=4), folder)  # 4 experts: EP 2 splits them
    return folder


def _run(tiny: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "load.json"
    rc = cli_main(["bench", "load", str(tiny), "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def _sane(row: dict) -> None:
    assert row["seconds"] > 0
    assert row["bytes_read"] is None or row["bytes_read"] > 0  # None until the loader counts them
    assert row["baseline"] > 0 and row["peak"] >= row["baseline"]
    assert row["peak_minus_baseline"] == row["peak"] - row["baseline"]
    assert row["ratio"] == pytest.approx(row["peak_minus_baseline"] / row["final_model_bytes"])
    assert row["peak_source"] == "VmHWM, reset at the baseline"
    assert row["check"] == ("PASS" if row["peak_minus_baseline"] <= row["limit"] else "FAIL")


def test_world_1_reports_the_models_own_bytes(tiny: Path, tmp_path: Path) -> None:
    rc, res = _run(tiny, tmp_path)
    model, _ = import_hf.load_model(tiny)
    own = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    (row,) = res["rows"]
    _sane(row)
    assert row["rank"] == 0 and row["final_model_bytes"] == own == res["model_bytes"]
    assert row["limit"] == int(1.15 * own)
    assert rc == (0 if row["check"] == "PASS" else 1)


@pytest.mark.slow  # ~22 s: two spawned gloo ranks
def test_world_2_expert_parallel_holds_about_half_the_model(tiny: Path, tmp_path: Path) -> None:
    rc, res = _run(tiny, tmp_path, "--nproc", "2", "--set", "parallel.ep_size=2")
    assert res["config"]["ep_size"] == 2 and len(res["rows"]) == 2
    whole = res["model_bytes"]
    limit = int(1.2 * whole / 2 + res["largest_tensor"]["bytes"])
    for rank, row in enumerate(res["rows"]):
        _sane(row)
        assert row["rank"] == rank and row["limit"] == limit
        # FSDP2 shards every parameter over the ranks, EP the experts: about half each (shard padding
        # and the replicated buffers, rope tables and the expert bias, on top)
        assert whole / 2 <= row["final_model_bytes"] < 0.75 * whole
    assert rc == (0 if all(r["check"] == "PASS" for r in res["rows"]) else 1)


def test_largest_tensor_is_read_from_the_headers(tiny: Path) -> None:
    from safetensors import safe_open

    sizes = {}
    for path in import_hf.shard_files(tiny):
        with safe_open(str(path), framework="pt") as f:
            sizes.update({n: f.get_tensor(n).nbytes for n in f.keys()})
    name, size = load_memory.largest_tensor(tiny)
    assert size == max(sizes.values()) and sizes[name] == size


def test_largest_tensor_of_a_file_with_several(tmp_path: Path) -> None:
    """One file, tensors one after another: a tensor's size is its span, not where it ends."""
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(64), "b": torch.zeros(40, dtype=torch.bfloat16), "c": torch.zeros(8)},
              str(tmp_path / "model.safetensors"))
    assert load_memory.largest_tensor(tmp_path) == ("a", 256)


def test_reset_peak_forgets_an_earlier_peak() -> None:
    """64 MiB touched and unmapped raise VmHWM but not VmRSS; the reset brings VmHWM back down."""
    import mmap

    block = mmap.mmap(-1, 64 * 2**20)
    block.write(b"x" * len(block))
    block.close()
    before = load_memory.vm_bytes("VmHWM")
    assert load_memory.reset_peak()
    assert load_memory.vm_bytes("VmHWM") <= before - 32 * 2**20


def test_resident_bytes_counts_each_storage_once() -> None:
    w = torch.zeros(4, 8)
    assert load_memory.resident_bytes([w, w[1], torch.zeros(3, dtype=torch.bfloat16)]) == 4 * 8 * 4 + 3 * 2


@pytest.mark.parametrize("argv, says", [
    (["--nproc", "0"], "--nproc 0: must be >= 1"),
    (["--nproc", "2", "--set", "parallel.ep_size=4"], "parallel.ep_size=4: must divide --nproc 2"),
    (["--nproc", "3", "--set", "parallel.ep_size=3"], "does not divide model.moe.num_experts=4"),
    (["--set", "train.device=meta"], "train.device='meta'"),
    (["--set", "model.nope=1"], "nope"),
])
def test_bad_input_is_refused_before_spawning(tiny: Path, argv: list[str], says: str,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(load.mp, "start_processes", lambda *a, **k: pytest.fail("spawned"))
    assert cli_main(["bench", "load", str(tiny), *argv]) == 2
    assert says in capsys.readouterr().err


def test_missing_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(load.mp, "start_processes", lambda *a, **k: pytest.fail("spawned"))
    assert cli_main(["bench", "load", str(tmp_path / "absent")]) == 2
    assert "absent': no such folder" in capsys.readouterr().err
    assert cli_main(["bench", "load", str(tmp_path)]) == 2  # a folder without config.json
    assert "no config.json" in capsys.readouterr().err


# published totals with the vocabulary (embedding and untied head), counted on the meta device
@pytest.mark.parametrize("shape, layers, params", [
    ("qwen3_30b_a3b", 1, 1_245_452_544), ("qwen3_30b_a3b", 2, 1_868_573_184),
    ("mixtral_8x7b", 1, 1_713_418_240), ("deepseek_v3_small", 2, 296_363_008),
])
def test_shapes_have_the_published_widths(shape: str, layers: int, params: int) -> None:
    assert hf_shapes.param_count(hf_shapes.SHAPES[shape](layers)) == params


def test_a_shape_is_written_in_bf16_and_imports(tmp_path: Path) -> None:
    """A tiny config through the same writer: sharded bf16 safetensors with per-expert names, norms in
    [0.5, 1.5], a tokenizer.json; import-hf's loader takes it as it is."""
    out = hf_shapes.write(qwen3_config(), tmp_path / "ckpt", shard_size="20KB")
    assert len(import_hf.shard_files(out)) > 1 and (out / "tokenizer.json").is_file()
    model, family = import_hf.load_model(out)
    assert family == "qwen3_moe"
    norm = model.blocks[1].attn_norm.weight
    assert norm.min() >= 0.5 and norm.max() <= 1.5 and norm.std() > 0
    from safetensors import safe_open

    with safe_open(str(import_hf.shard_files(out)[0]), framework="pt") as f:
        assert {f.get_tensor(n).dtype for n in f.keys()} == {torch.bfloat16}
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names
    with pytest.raises(ValueError, match="not an empty folder"):
        hf_shapes.write(qwen3_config(), out)


def test_shapes_cli_refuses_bad_layers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert hf_shapes.main(["mixtral_8x7b", "--layers", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--layers=0" in capsys.readouterr().err and not (tmp_path / "x").exists()

