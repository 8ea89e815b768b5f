"""The hf commands end to end: `dropless import-hf` writes a run that `train --resume`, `generate` and
`evaluate` take; `dropless train --init-from hf:DIR` fine-tunes a checkpoint with its tokenizer and
its family's balancing rule (said in the log); the trained run exports back to a folder transformers
loads, with dropless's logits; bad input exits 2 and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_models import VOCAB, mixtral_config, qwen3_config, save_hf, transformers
from tolerances import REFERENCE, assert_close

from dropless.cli import main as cli
from dropless.runs.load import load_model

# 2 steps of 2 x 32 tokens of the embedded corpus, fp32 on the CPU, quiet
SMOKE = ["train.steps=2", "train.warmup_steps=0", "train.batch_size=2", "train.seq_len=32",
         "train.eval_batches=1", "train.device=cpu", "train.dtype=fp32", "data.max_bytes=100000",
         "log.progress=false", "log.plots=false", "log.tensorboard=false"]


# the fine-tune check: 20 steps (lr 1e-2 on a random-weight model), the loss must fall
FINE_TUNE = SMOKE + ["train.steps=20", "train.lr=1e-2", "train.eval_every=10", "log.log_every=1"]


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen")
    save_hf(qwen3_config(), d)
    return d


def test_import_then_resume_generate_evaluate(qwen_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()  # an empty --out folder is taken
    # (a small slice of the corpus: evaluate tokenizes it with the HF tokenizer)
    # (a balancing coefficient may change on import: it is not part of the weights' model)
    assert cli(["import-hf", str(qwen_dir), "--out", str(run), "--no-progress", "--set", "data.max_bytes=100000",
                "--set", "model.moe.balance.aux_loss_coeff=0.05"]) == 0
    assert ("balancing: aux loss per MoE layer, coefficient 0.05 (set by --set; qwen3_moe's rule gives 0.01)"
            in capsys.readouterr().out)
    model, cfg = load_model(run)
    assert cfg.data.tokenizer == "hf" and Path(cfg.data.tokenizer_path) == run / "tokenizer" / "tokenizer.json"
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    x = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the run's checkpoint holds the imported weights
        assert_close(model(x).logits, hf(x).logits, REFERENCE[torch.float32], "imported run")
    # generate (KV cache, grouped-query attention), with the checkpoint's tokenizer
    assert cli(["generate", "--run-dir", str(run), "--prompt", "def f", "--max-new-tokens", "4",
                "--temperature", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def f")
    assert cli(["evaluate", "--run-dir", str(run), "--device", "cpu", "--max-batches", "1"]) == 0
    assert "val_loss" in capsys.readouterr().out
    assert cli(["train", "--run-dir", str(run), "--resume", *sets(*SMOKE)]) == 0
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [0, 1]


def test_init_from_fine_tunes_and_exports_to_transformers(qwen_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    assert cli(["train", "--init-from", f"hf:{qwen_dir}", "--run-dir", str(run), *sets(*FINE_TUNE)]) == 0
    log = capsys.readouterr().out
    assert (f"initialised from {qwen_dir}; balancing: aux loss per MoE layer, coefficient 0.01 (qwen3_moe's "
            "rule: router_aux_loss_coef x top_k 2 / 2 MoE layers") in log
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["balancing"].startswith("balancing: aux loss")
    losses = [r for r in rows if "loss" in r]
    assert len(losses) == 20 and all(r["moe_loss"] > 0 for r in losses)  # the aux loss is on
    # measured 5.77 at step 0, 3.6-3.9 over the last five steps
    assert sum(r["ce_loss"] for r in losses[-5:]) / 5 < losses[0]["ce_loss"] - 1.0
    model, cfg = load_model(run)
    assert cfg.data.tokenizer_path == str(qwen_dir / "tokenizer.json")
    out.mkdir()  # an empty --out folder is taken
    assert cli(["export-hf", str(run), "--out", str(out), "--family", "qwen3_moe",
                "--max-shard-size-mb", "0.02"]) == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                 dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    x = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(hf.eval()(x).logits, model(x).logits, REFERENCE[torch.float32], "trained, exported")
    src = transformers.AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # training moved the weights
        assert not torch.allclose(src(x).logits, model(x).logits)


def test_init_from_matches_the_checkpoint_before_training(qwen_dir: Path, tmp_path: Path) -> None:
    """The trainer's model right after `init_weights` is the HF model (the hook runs before the
    model is moved or any step is taken)."""
    from dropless.hf import import_hf
    from dropless.config import load_config
    from dropless.train.loop import Trainer

    cfg = import_hf.init_config(qwen_dir, load_config(None, SMOKE[:1] + ["train.warmup_steps=0"]), SMOKE)
    trainer = Trainer(cfg, tmp_path / "run", init_weights=import_hf.weight_loader(qwen_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    x = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_close(trainer.model.eval()(x).logits, hf(x).logits, REFERENCE[torch.float32], "init_from")


def _nothing_written(parent: Path, name: str) -> bool:
    return not (parent / name).exists() and not any(p.name.startswith(f".{name}.") for p in parent.iterdir())


@pytest.mark.parametrize("case", ["no_tokenizer", "unknown_architecture", "out_not_empty", "missing_shard", "tokenizer_too_big",
                                  "model_override"])
def test_import_bad_input_exits_2_and_writes_nothing(tmp_path: Path, case: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    save_hf(mixtral_config(), src, tokenizer=case != "no_tokenizer")
    if case == "unknown_architecture":
        c = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**c, "model_type": "llama"}))
    if case == "missing_shard":
        next(src.glob("model-00002-*.safetensors")).unlink()
    if case == "tokenizer_too_big":  # found after the run folder was begun: it must be removed again
        from hf_models import write_tokenizer

        write_tokenizer(src, added=40)
    out = tmp_path / "run"
    if case == "out_not_empty":
        out.mkdir()
        (out / "keep").write_text("x")
    capsys.readouterr()  # (save_pretrained's progress bar)
    extra = ["--set", "model.moe.top_k=1"] if case == "model_override" else []
    assert cli(["import-hf", str(src), "--out", str(out), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless import-hf: error: ")
    expect = {"no_tokenizer": "no tokenizer.json", "unknown_architecture": "model_type='llama'",
              "out_not_empty": f"--out={str(out)!r}: exists and is not an empty folder",
              "missing_shard": "model-00002-of-",
              "tokenizer_too_big": f"more than config.json vocab_size={VOCAB}",
              "model_override": "model.moe.top_k comes from config.json"}[case]
    assert expect in err
    if case == "out_not_empty":
        assert [p.name for p in out.iterdir()] == ["keep"]
    else:
        assert _nothing_written(tmp_path, "run")


def test_export_refusal_exits_2_and_writes_nothing(qwen_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert cli(["import-hf", str(qwen_dir), "--out", str(run), "--no-progress"]) == 0
    capsys.readouterr()
    assert cli(["export-hf", str(run), "--out", str(tmp_path / "out"), "--family", "mixtral"]) == 2
    assert "model.qk_norm=True: mixtral cannot express it" in capsys.readouterr().err
    assert _nothing_written(tmp_path, "out")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("x")
    assert cli(["export-hf", str(run), "--out", str(full), "--family", "qwen3_moe"]) == 2
    assert f"--out={str(full)!r}: exists and is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in full.iterdir()] == ["keep"]
    assert not any(p.name.startswith(".full.") for p in tmp_path.iterdir())
