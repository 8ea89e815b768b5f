"""Chat fine-tuning end to end: a packed batch of conversations takes exactly the loss of its
assistant tokens, example by example; `dropless train --init-from hf:DIR` with a chat JSONL as the
only source trains on it (and its prepared folder gives the same tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tolerances import DOC_MASK, assert_close

from dropless.check.chat_fixture import write_chat_setup
from dropless.config import DataConfig, ModelConfig, RunConfig, apply_overrides
from dropless.data.splits import load_runs, split_windows
from dropless.data.tokenizer import load_tokenizer
from dropless.data.windows import IGNORE_INDEX
from dropless.model import MoEModel

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_chat_setup(tmp_path_factory.mktemp("chat"), n=80)


def _model(attention: str) -> MoEModel:
    extra = (["model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.rope_head_dim=8",
              "model.v_head_dim=16"] if attention == "mla" else
             ["model.n_heads=4", "model.n_kv_heads=2"] if attention == "gqa" else [])
    cfg = apply_overrides(RunConfig(), ["model.vocab_size=320", "model.d_model=64", "model.n_layers=2",
                                        "model.n_heads=2", "model.max_seq_len=128", "train.seq_len=128", "model.n_dense_layers=0",
                                        "model.moe.num_experts=4", "model.moe.d_expert=32", *extra])
    return MoEModel(cfg.model, seed=0).eval()


@pytest.mark.parametrize("attention", ["mha", "gqa", "mla"])
def test_packed_chat_loss_is_the_assistant_mean_of_each_example(chat, attention):
    tokenizer, data = chat
    d = DataConfig(sources=[str(data)], tokenizer="hf", tokenizer_path=str(tokenizer))
    S = 120
    train, _ = split_windows(d, load_runs(d, load_tokenizer("hf", str(tokenizer)), S), S)
    w = train.draw(0, 0, 3, seed=5)
    assert int(w.segments_BS.max()) >= 1  # several conversations in a row
    model = _model(attention)
    with torch.no_grad():
        packed = model(w.x_BS, w.y_BS, segments_BS=w.segments_BS).ce_loss
        total, count = torch.zeros((), dtype=torch.float64), 0
        for b in range(w.x_BS.shape[0]):
            for j in w.segments_BS[b].unique().tolist():
                at = w.segments_BS[b] == j
                x, y = w.x_BS[b, at][None], w.y_BS[b, at][None]
                n = int((y != IGNORE_INDEX).sum())
                if n:  # each example alone, from position 0: its mean over its assistant targets
                    total += model(x, y).ce_loss.double() * n
                    count += n
        # the definition, read off the data: every target kept is an assistant token of its own example
        assert count == int((w.y_BS != IGNORE_INDEX).sum()) > 0
        assert_close(packed.double(), total / count, DOC_MASK, "packed chat loss")
        # the same rows without their documents' mask fail the same check (the test can fail)
        leaked = model(w.x_BS, w.y_BS).ce_loss
        with pytest.raises(AssertionError):
            assert_close(leaked.double(), total / count, DOC_MASK, "unmasked")


def test_init_from_hf_trains_on_chat_data(chat, tmp_path: Path):
    from hf_models import qwen3_config, save_hf

    from dropless.cli import main as cli

    tokenizer, data = chat
    hf = tmp_path / "hf"
    save_hf(qwen3_config(max_position_embeddings=128), hf, tokenizer=False)
    for f in tokenizer.parent.iterdir():  # the checkpoint ships the chat tokenizer
        (hf / f.name).write_bytes(f.read_bytes())
    run = tmp_path / "run"
    sets = ["train.steps=4", "train.warmup_steps=0", "train.batch_size=2", "train.seq_len=96", "train.eval_every=2", "train.eval_batches=1",
            "train.device=cpu", "train.dtype=fp32", "log.log_every=1", "log.progress=false", "log.plots=false",
            "log.tensorboard=false", f'data.sources=["{data}"]']
    assert cli(["train", "--init-from", f"hf:{hf}", "--run-dir", str(run),
                *[a for s in sets for a in ("--set", s)]]) == 0
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["ce_loss"] for r in rows if "ce_loss" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(losses) == 4 and len(vals) == 2 and all(torch.isfinite(torch.tensor(losses + vals)))
    assert all(r["data_ms"] >= 0 for r in rows if "ce_loss" in r)
    # a prepared folder of the same file trains on the same conversations (the run's template checked)
    out = tmp_path / "prepared"
    assert cli(["prepare-data", str(data), "--out", str(out), "--tokenizer", f"hf:{hf}", "--no-progress"]) == 0
    d_mem = DataConfig(sources=[str(data)], tokenizer="hf", tokenizer_path=str(hf / "tokenizer.json"))
    d_prep = DataConfig(prepared=str(out), tokenizer="hf", tokenizer_path=str(hf / "tokenizer.json"))
    tok = load_tokenizer("hf", str(hf / "tokenizer.json"))
    mem, prep = load_runs(d_mem, tok, 96), load_runs(d_prep, tok, 96)
    assert prep.chat and torch.equal(torch.from_numpy(mem.train[0].tokens),
                                     torch.cat([torch.from_numpy(r.tokens.astype("int64")) for r in prep.train]))
