"""Published layer shapes through the whole path, at real widths (slow: GBs of RAM, minutes of CPU).

For each shape of bench/hf_shapes.py (Qwen3-30B-A3B, Mixtral-8x7B, a reduced DeepSeek-V3), cut to
one or two layers and saved in bf16 by transformers: import in one process, logits against
transformers on the same tokens within 1e-4 (fp32); import at world 4 (EP 4, and EP 2 x FSDP 2),
the same checkpoint bits as the one-process import; a 3-step fine-tune at world 4 (the reduced
DeepSeek-V3 only: with AdamW the fp32 states of a 1.2-1.7B layer do not fit beside the others on a
24 GiB machine); export from the world-4 run, reloaded by transformers, logits within 1e-4 of the
run's. A command more than a test: it needs more memory than the suite may take, so it runs only
when asked, one shape at a time:

    DROPLESS_REAL_SHAPES=1 pytest -s tests/test_hf_real_shapes.py -k qwen3

The test process peaks at 4.7 / 14.6 / 19.0 GB (DeepSeek / Qwen3 / Mixtral: transformers' own fp32
load of the bf16 files is the largest step), on 2 cores in 1.7 / 2.2 / 3.3 minutes.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dropless.bench import hf_shapes  # noqa: E402
from dropless.cli import main as cli  # noqa: E402
from dropless.hf import import_hf  # noqa: E402
from dropless.runs.checkpoint import latest_checkpoint  # noqa: E402
from dropless.runs.dcp_tensors import open_tensors  # noqa: E402
from dropless.runs.load import load_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.environ.get("DROPLESS_REAL_SHAPES"), reason="GBs of RAM: set DROPLESS_REAL_SHAPES=1 (module note)")]
ATOL = 1e-4  # fp32 logits: the same function, summed in another order


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(0))


def _hf_logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(x).logits
    del hf
    gc.collect()
    return out


def _dl_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(x).logits
    del model
    gc.collect()
    return out


def _same_weights(a: Path, b: Path) -> None:
    """The two runs' step-0 checkpoints hold the same tensors, compared one at a time."""
    one, two = (open_tensors(latest_checkpoint(r)) for r in (a, b))
    assert one.specs == two.specs
    for name in one.specs:
        assert torch.equal(one.read(name), two.read(name)), name


@pytest.mark.parametrize("shape,layers,fine_tune", [("qwen3_30b_a3b", 1, False), ("mixtral_8x7b", 1, False),
                                                    ("deepseek_v3_small", 2, True)])
def test_published_shape_round_trip(tmp_path: Path, shape: str, layers: int, fine_tune: bool) -> None:
    config = hf_shapes.SHAPES[shape](layers)
    hf_dir = hf_shapes.write(config, tmp_path / "hf", shard_size="300MB")
    x = _tokens(config.vocab_size)
    ref = _hf_logits(hf_dir, x)
    model, _ = import_hf.load_model(hf_dir)
    got = _dl_logits(model, x)
    print(f"{shape}: |import - transformers| max {(got - ref).abs().max().item():.3g} (logits up to "
          f"{ref.abs().max().item():.3g})")
    assert (got - ref).abs().max().item() <= ATOL, "one-process import vs transformers"
    one, four, four_b = tmp_path / "one", tmp_path / "four", tmp_path / "four_b"
    assert cli(["import-hf", str(hf_dir), "--out", str(one), "--no-progress"]) == 0
    assert cli(["import-hf", str(hf_dir), "--out", str(four), "--no-progress", "--nproc", "4",
                "--set", "parallel.ep_size=4"]) == 0
    _same_weights(one, four)
    assert cli(["import-hf", str(hf_dir), "--out", str(four_b), "--no-progress", "--nproc", "4",
                "--set", "parallel.ep_size=2"]) == 0
    _same_weights(one, four_b)
    if fine_tune:
        assert cli(["train", "--resume", "--run-dir", str(four), "--nproc", "4", "--set", "train.steps=3",
                    "--set", "train.batch_size=1", "--set", "train.seq_len=32", "--set", "train.eval_every=3",
                    "--set", "train.ckpt_every=3", "--set", "log.progress=false",
                    "--set", "data.max_bytes=200000"]) == 0
    family = import_hf.read_config(hf_dir)["model_type"]
    out = tmp_path / "export"
    assert cli(["export-hf", str(four), "--out", str(out), "--family", family, "--no-progress",
                "--max-shard-size-mb", "300"]) == 0
    model, _ = load_model(four)
    mine = _dl_logits(model, x)
    if not fine_tune:
        assert torch.equal(mine, got)  # the world-4 import is the same model
    exported = _hf_logits(out, x)
    print(f"{shape}: |export from world 4 (transformers) - run| max {(exported - mine).abs().max().item():.3g}")
    assert (exported - mine).abs().max().item() <= ATOL, "export from world 4, reloaded by transformers"
