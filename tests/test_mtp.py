"""Multi-token prediction, `model.mtp_depth` / `model.mtp_weight` / `model.mtp_block` (layers/mtp.py):
the model's loss and every gradient against a plain reference that indexes the full token sequence
directly (module k at position t reads token t+k and predicts token t+k+1; the projection reads
[embedding; hidden], DeepSeek-V3's order), with dense and MoE blocks; training only (evaluation and
generation never run the modules); the trainer logs the MTP loss apart from ce_loss and moves the
MTP MoE blocks' expert bias with the main layers'.

Bit-exactness (torch.equal) is claimed because the reference runs the same modules on the same
inputs at the same shapes (docs/numerics.md), on the CPU in fp32."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dropless.config import ModelConfig
from dropless.layers import mtp as mtp_mod
from dropless.model import MoEModel
from dropless.train.loop import Trainer
from test_model_knobs import grads, model_cfg
from tiny_run import rows, tiny

B, S = 2, 12


def sequence() -> torch.Tensor:
    return torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(4))


def reference_loss(model: MoEModel, full_BS1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(main ce + moe losses + weight * mean_k ce_k, mean_k ce_k) from the full sequence of S + 1."""
    cfg = model.cfg
    tok, tgt = full_BS1[:, :S], full_BS1[:, 1:]
    cos, sin = model.rope_cos, model.rope_sin
    x = model.embed(tok)
    moe = []
    for block in model.blocks:
        out = block(x, cos[:S], sin[:S], token_ids=tok)
        x = out.x
        if out.moe is not None:
            moe.append(out.moe)
    ce = F.cross_entropy(model.head(model.norm(x)).float().reshape(B * S, -1), tgt.reshape(-1))
    h, losses, mtp_moe = x, [], []
    for k, m in enumerate(model.mtp, start=1):
        n = S - k
        e = model.embed(full_BS1[:, k:k + n])  # token t+k at position t
        z = m.proj(torch.cat([m.embed_norm(e), m.hidden_norm(h[:, :n])], dim=-1))
        out = m.block(z, cos[:n], sin[:n], token_ids=full_BS1[:, k:k + n])  # hash routing: the token read
        h = out.x
        if out.moe is not None:
            mtp_moe.append(out.moe)
        logits = model.head(m.out_norm(h)).float()
        losses.append(F.cross_entropy(logits.reshape(B * n, -1), full_BS1[:, k + 1:k + 1 + n].reshape(-1)))
    mtp = sum(losses[1:], losses[0]) / len(losses)
    loss = ce + model.balancing_loss(moe) + cfg.mtp_weight * mtp
    return (loss + model.balancing_loss(mtp_moe) if mtp_moe else loss), mtp


@pytest.mark.parametrize("block", ["dense", "moe"])
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("recompute", [[], ["layer"], ["attn", "norm"]], ids=lambda r: "+".join(r) or "none")
def test_mtp_against_reference(depth: int, recompute: list[str], block: str) -> None:
    """With MoE blocks the sequence aux loss is on too, so each balancing loss of the MTP blocks is
    in the total (with the main layers' coefficients, not times mtp_weight)."""
    cfg = model_cfg(f"model.mtp_depth={depth}", "model.mtp_weight=0.5", f"model.mtp_block={block}",
                    "model.moe.balance.seq_aux_loss_coeff=0.01")
    torch.manual_seed(0)
    model = MoEModel(replace(cfg, recompute=recompute))
    assert len(model.mtp) == depth and len(model.mtp_moe_layers()) == (depth if block == "moe" else 0)
    assert len(model.moe_layers()) == cfg.n_moe_layers  # the main model's alone
    full = sequence()
    out = model(full[:, :S], full[:, 1:])
    got = grads(model, out.loss)
    want_loss, want_mtp = reference_loss(model, full)
    assert torch.equal(out.mtp_loss, want_mtp)
    assert torch.equal(out.loss, want_loss)
    assert len(out.moe) == cfg.n_moe_layers and len(out.mtp_moe) == len(model.mtp_moe_layers())
    if block == "moe":
        assert all(m.seq_aux_loss is not None and m.seq_aux_loss > 0 for m in out.mtp_moe)
    want = grads(model, want_loss)
    assert got.keys() == want.keys()
    for n in got:
        assert torch.equal(got[n], want[n]), n
    assert any(n.startswith("mtp.") for n in got) and "embed.weight" in got


def test_mtp_moe_block_with_hash_routing() -> None:
    """A hash-routed MoE block in an MTP module routes by the token the module embeds."""
    cfg = model_cfg("model.mtp_depth=2", "model.mtp_block=moe", "model.moe.router.strategy=hash",
                    "model.moe.router.hash_buckets=64")
    torch.manual_seed(0)
    model = MoEModel(cfg)
    full = sequence()
    out = model(full[:, :S], full[:, 1:])
    want_loss, want_mtp = reference_loss(model, full)
    assert torch.equal(out.mtp_loss, want_mtp) and torch.equal(out.loss, want_loss)


def test_mtp_off_by_default_and_in_eval() -> None:
    assert ModelConfig().mtp_depth == 0
    torch.manual_seed(0)
    model = MoEModel(model_cfg("model.mtp_depth=2"))
    full = sequence()
    out = model(full[:, :S], full[:, 1:])
    assert out.mtp_loss is not None and not torch.equal(out.loss, out.ce_loss + out.moe_loss)
    model.eval()  # evaluation: the main loss alone, the modules not run
    out = model(full[:, :S], full[:, 1:])
    assert out.mtp_loss is None and torch.equal(out.loss, out.ce_loss + out.moe_loss)


def test_mtp_validation() -> None:
    with pytest.raises(ValueError, match=r"model\.mtp_depth=-1"):
        ModelConfig(mtp_depth=-1)
    with pytest.raises(ValueError, match=r"model\.mtp_depth=8: must be < max_seq_len=8"):
        ModelConfig(mtp_depth=8, max_seq_len=8)
    with pytest.raises(ValueError, match=r"model\.mtp_weight=-0.1"):
        ModelConfig(mtp_weight=-0.1)
    with pytest.raises(ValueError, match=r"model\.mtp_block='sparse'"):
        ModelConfig(mtp_block="sparse")
    # the global-batch aux loss's pre-pass never runs the MTP modules: refused with MoE blocks
    with pytest.raises(ValueError, match=r"model\.mtp_block='moe'.*global_aux_loss_coeff=0.01"):
        model_cfg("model.mtp_depth=1", "model.mtp_block=moe", "model.moe.balance.global_aux_loss_coeff=0.01")
    model_cfg("model.mtp_depth=1", "model.moe.balance.global_aux_loss_coeff=0.01")  # dense blocks: fine


def test_trainer_moves_the_mtp_moe_expert_bias(tmp_path: Path) -> None:
    """Loss-free balancing with MoE MTP blocks: the trainer's bias rule moves the MTP routers' bias
    as it moves the main ones' (from their own counts), the routing record keeps the main layers
    only, and the bias is in the checkpoint."""
    from dropless.runs.load import load_model

    cfg = tiny("model.mtp_depth=1", "model.mtp_block=moe", "model.moe.router.use_expert_bias=true",
               "model.moe.balance.bias_update_rate=0.01", "train.steps=2", "train.eval_every=2",
               "train.ckpt_every=2")
    trainer = Trainer(cfg, tmp_path)
    assert len(trainer.model.mtp_moe_layers()) == 1
    trainer.fit()
    model, _ = load_model(tmp_path)
    bias = model.mtp_moe_layers()[0].router.expert_bias
    assert bias.abs().max() > 0 and all(layer.router.expert_bias.abs().max() > 0 for layer in model.moe_layers())
    routing = [json.loads(line) for line in (tmp_path / "routing.jsonl").read_text().splitlines()]
    per_layer = [v for r in routing for v in r.values() if isinstance(v, list)]
    assert routing and per_layer and all(len(v) == cfg.model.n_moe_layers for v in per_layer)


def test_trainer_logs_mtp_apart_and_evaluates_the_main_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny("model.mtp_depth=1", "train.steps=2", "train.eval_every=2", "train.ckpt_every=2")
    trainer = Trainer(cfg, tmp_path)
    trainer.fit()
    train_rows = rows(tmp_path, "ce_loss")
    assert train_rows and all("mtp_loss" in r and r["mtp_loss"] > 0 for r in train_rows)
    for r in train_rows:  # loss = ce + moe + weight * mtp
        assert abs(r["loss"] - (r["ce_loss"] + r["moe_loss"] + 0.3 * r["mtp_loss"])) < 1e-4
    calls = []
    monkeypatch.setattr(mtp_mod.MTPModule, "forward", lambda *a: calls.append(1))
    trainer.evaluate()
    assert not calls


def test_mtp_refuses_a_sequence_without_a_target_for_its_last_module() -> None:
    """With depth D, module D at position t predicts token t+D+1: a training call of D positions or
    fewer leaves it no target (an empty mean, NaN), so the model refuses it by name."""
    torch.manual_seed(0)
    model = MoEModel(model_cfg("model.mtp_depth=3"))
    full = sequence()
    assert torch.isfinite(model(full[:, :4], full[:, 1:5]).loss)  # 4 positions: module 3 has one
    with pytest.raises(ValueError, match=r"model\.mtp_depth=3: module 3 predicts token t\+4.*got 3"):
        model(full[:, :3], full[:, 1:4])


def test_depth_must_leave_the_training_window_a_target(tmp_path: Path) -> None:
    """A window of seq_len inputs gives module D seq_len - D targets: depth seq_len is refused naming
    both fields (every loss was NaN), depth seq_len - 1 (module D sees one position) trains."""
    with pytest.raises(ValueError, match=r"model\.mtp_depth=4: must be < train\.seq_len=4"):
        tiny("train.seq_len=4", "model.mtp_depth=4")
    cfg = tiny("train.seq_len=4", "model.mtp_depth=3", "train.steps=2", "train.eval_every=2",
               "train.ckpt_every=2")
    Trainer(cfg, tmp_path).fit()
    train_rows = rows(tmp_path, "mtp_loss")
    assert len(train_rows) == 2 and all(0 < r["mtp_loss"] < float("inf") for r in train_rows)
    assert all(r["loss"] < float("inf") for r in train_rows)
