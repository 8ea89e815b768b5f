"""`dropless quantize` (serve/quantize.py, runs/packed.py): quantise -> load -> evaluate on a tiny
trained run, and bad inputs that must fail cleanly without writing anything."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dropless import cli
from dropless.config import to_dict
from dropless.expert_slots import ExpertSlots
from dropless.layers.packed_experts import PackedExperts
from dropless.model import MoEModel
from dropless.ops.quant import fake_quantize
from dropless.runs import packed
from dropless.serve.evaluate import val_loss
from dropless.runs.load import load_model, run_config
from dropless.serve.quantize import distinct_experts
from dropless.runs.checkpoint import save_checkpoint
from dropless.train.loop import Trainer
from tiny_run import tiny
from tolerances import REFERENCE, assert_close

FORMATS = ("mxfp4", "nvfp4")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained for 4 steps (d_model = d_expert = 32: whole mxfp4 and nvfp4 blocks)."""
    run = tmp_path_factory.mktemp("serve_quant") / "run"
    Trainer(tiny("train.steps=4", "train.ckpt_every=4", "train.eval_every=4"), run).fit()
    return run


def _fake_quantised(run: Path, fmt: str) -> MoEModel:
    """The original model with every expert matrix replaced by ops.quant.fake_quantize of it, blocked
    along its reduction dim, NVFP4's tensor scale per expert: what the packed model must compute."""
    model, _ = load_model(run)
    with torch.no_grad():
        for layer in model.moe_layers():
            for w in (layer.experts.w_gate_up_EDF, layer.experts.w_down_EFD):
                w.copy_(torch.stack([fake_quantize(w_e, fmt, dim=0) for w_e in w]))
    return model


def _listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_load_evaluate_round_trip(trained: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "q"
    assert cli.main(["quantize", str(trained), "--experts", fmt, "--out", str(out)]) == 0
    assert _listing(out) == ["config.toml", "quantized", "quantized/manifest.json", "quantized/model.pt"]
    manifest = json.loads((out / "quantized" / "manifest.json").read_text())
    assert (manifest["experts"], manifest["source_step"]) == (fmt, 4)

    q, cfg_q = load_model(out)
    orig, cfg = load_model(trained)
    assert to_dict(cfg_q) == to_dict(cfg) and to_dict(run_config(out)[0]) == to_dict(cfg)
    # in memory: only packed bytes for the experts (no fp32 copies), everything else bit-identical
    sq, so = q.state_dict(), orig.state_dict()
    expert_keys = {k for k in so if ".experts.w_" in k}
    assert expert_keys and not expert_keys & set(sq)
    for k in so.keys() - expert_keys:
        assert sq[k].dtype == so[k].dtype and torch.equal(sq[k], so[k]), k
    for layer in q.moe_layers():
        assert isinstance(layer.experts, PackedExperts)
        assert all(b.dtype in (torch.uint8, torch.int32) for b in layer.experts.buffers())

    ref = _fake_quantised(trained, fmt)
    x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(q(x).logits, ref(x).logits, REFERENCE[torch.float32], f"{fmt} logits")
        with torch.autocast("cpu", dtype=torch.bfloat16):  # how --report evaluates
            assert_close(q(x).logits, ref(x).logits, REFERENCE[torch.bfloat16], f"{fmt} bf16 logits")
    # evaluate runs from the packed run: the loss agrees to the fp32 floor, and it is not the original's
    loss_q, loss_ref = val_loss(q, cfg, max_batches=1), val_loss(ref, cfg, max_batches=1)
    assert abs(loss_q - loss_ref) <= REFERENCE[torch.float32].rtol * abs(loss_ref)
    assert loss_q != val_loss(orig, cfg, max_batches=1)

    # serving-time config changes keep working (load_model's model_cfg): top_k 2 -> 1
    q1, cfg1 = load_model(out, model_cfg=lambda m: replace(m, moe=replace(m.moe, top_k=1)))
    assert cfg1.model.moe.top_k == 1 and q1.moe_layers()[0].router.top_k == 1


def test_report_bytes_follow_from_the_shapes(trained: Path, tmp_path: Path, capsys) -> None:
    report = tmp_path / "r.json"
    assert cli.main(["quantize", str(trained), "--report", "--max-batches", "1", "--json", str(report)]) == 0
    assert "val_loss" in capsys.readouterr().out
    r = json.loads(report.read_text())
    rows = {row["variant"]: row for row in r["rows"]}
    assert list(rows) == ["original", "mxfp4", "nvfp4"]
    E, D, F, L, K = 4, 32, 32, 1, 2
    params = E * (D * 2 * F + F * D)
    # codes (half a byte per weight) + one scale byte per block (+ two fp32 tensor scales for nvfp4)
    expect = {"original": 4 * params, "mxfp4": params // 2 + params // 32,
              "nvfp4": params // 2 + params // 16 + 2 * 4 * E}
    for name, row in rows.items():
        assert row["expert_bytes"] == L * expect[name], name
        non_expert = rows["original"]["memory_bytes"] - rows["original"]["expert_bytes"]
        assert row["memory_bytes"] == non_expert + row["expert_bytes"], name
        one = row["read_per_token_rest_stored"]["1"]
        assert one == non_expert + L * K * expect[name] // E, name  # K experts per token at B = 1
    assert rows["original"]["val_loss_change"] == 0.0
    assert r["distinct_experts_per_layer"]["1"] == [2.0]  # K distinct experts for one token


def test_distinct_experts_on_hand_made_routing() -> None:
    # 4 sequences of 2 tokens, K=2 of E=4. Position 0: every sequence picks {0, 1}. Position 1:
    # sequence i picks {i, i+1 mod 4}, and sequence 0's second slot is empty (valid False).
    # B=1: 2 experts per token except that one token (1): 15/8. B=4: position 0 reads 2, position 1
    # reads all 4: 3. The strategy's empty slot must not count, its id (1) notwithstanding.
    cfg = tiny("train.batch_size=4", "train.seq_len=2")
    ids = torch.zeros(4, 2, 2, dtype=torch.int64)
    ids[:, 0] = torch.tensor([0, 1])
    ids[:, 1, 0] = torch.arange(4)
    ids[:, 1, 1] = (torch.arange(4) + 1) % 4
    valid = torch.ones(4, 2, 2, dtype=torch.bool)
    valid[0, 1, 1] = False

    def model(x):
        assert x.shape == (4, 2)
        return SimpleNamespace(moe=[SimpleNamespace(ids_TK=ids.view(8, 2), valid_TK=valid.view(8, 2))])

    model.expert_slots = lambda: ExpertSlots(4)
    got = distinct_experts(model, cfg, _windows(cfg))
    assert got == {1: [15 / 8], 4: [3.0]}


def _state_pt_run(path: Path, *overrides: str) -> Path:
    """A run directory with one state.pt checkpoint of an untrained model of tiny(*overrides)."""
    cfg = tiny(*overrides)
    save_checkpoint(path, 0, {"config": to_dict(cfg), "model": MoEModel(cfg.model).state_dict()})
    return path


def test_bad_inputs_fail_clearly_and_write_nothing(trained: Path, tmp_path: Path, capsys,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(args: list[str], message: str) -> None:
        before = _listing(tmp_path)
        assert cli.main(["quantize", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dropless quantize: error:") and message in err, err
        assert _listing(tmp_path) == before  # nothing written, no temporary folder left behind

    empty = tmp_path / "empty_run"
    empty.mkdir()
    fails([str(empty), "--experts", "mxfp4", "--out", str(tmp_path / "a")], "no complete checkpoint")
    fails([str(trained), "--experts", "int4", "--out", str(tmp_path / "a")], "experts='int4'")
    fails([str(trained), "--experts", "int4", "--report"], "experts='int4'")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    fails([str(trained), "--experts", "mxfp4", "--out", str(full)], f"--out={str(full)!r}: exists and is not an empty folder")
    assert (full / "keep.txt").read_text() == "mine"
    odd = _state_pt_run(tmp_path / "odd_run", "model.moe.d_expert=40")  # 40: not 32k, not 16k
    for fmt in FORMATS:
        fails([str(odd), "--experts", fmt, "--out", str(tmp_path / "a")], "model.moe.d_expert=40")
    fails([str(trained), "--out", str(tmp_path / "a")], "--experts is required")
    dense = _state_pt_run(tmp_path / "dense_run", "model.n_dense_layers=2")
    fails([str(dense), "--experts", "mxfp4", "--out", str(tmp_path / "a")], "no routed experts")
    # a failure in the middle of the write (here: the tensor file) leaves nothing either
    real_save = torch.save

    def broken_save(obj, f, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        cli.main(["quantize", str(trained), "--experts", "mxfp4", "--out", str(tmp_path / "b")])
    monkeypatch.setattr(torch, "save", real_save)
    assert not (tmp_path / "b").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    # an empty --out directory is accepted and filled
    (tmp_path / "c").mkdir()
    assert cli.main(["quantize", str(trained), "--experts", "mxfp4", "--out", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "quantized" / "model.pt").is_file()
    capsys.readouterr()
    fails([str(tmp_path / "c"), "--experts", "nvfp4", "--out", str(tmp_path / "d")], "already a packed run")


def test_quantize_and_evaluate_a_run_with_identity_experts_and_mtp(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """The quality knobs the default preset may carry serve like the plain model: a run with an
    identity expert and an MTP module quantizes (the identity expert has no weights to pack, the MTP
    block is dense and stays as trained), loads, evaluates its main loss alone, and sweeps top-k."""
    run, out = tmp_path / "run", tmp_path / "q"
    Trainer(tiny("train.steps=4", "train.ckpt_every=4", "train.eval_every=4",
                 "model.moe.n_identity_experts=1", "model.mtp_depth=1"), run).fit()
    assert cli.main(["quantize", str(run), "--experts", "mxfp4", "--out", str(out)]) == 0
    q, cfg = load_model(out)
    orig, _ = load_model(run)
    assert cfg.model.moe.n_identity_experts == 1 and cfg.model.mtp_depth == 1
    for k, v in orig.state_dict().items():
        if k.startswith("mtp."):
            assert torch.equal(q.state_dict()[k], v), k
    ref = _fake_quantised(run, "mxfp4")
    x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(q(x).logits, ref(x).logits, REFERENCE[torch.float32], "identity+mtp mxfp4 logits")
    loss_q = val_loss(q, cfg, max_batches=1)
    assert abs(loss_q - val_loss(ref, cfg, max_batches=1)) <= REFERENCE[torch.float32].rtol * loss_q
    capsys.readouterr()
    assert cli.main(["evaluate", "--run-dir", str(out), "--serve-sweep", "--max-batches", "1"]) == 0
    sweep = capsys.readouterr().out
    assert "| 2 | 2 | trained |" in sweep and "| 1 | 1 |" in sweep


def _windows(cfg):
    """1000 tokens 0..255, 0.. as one validation run (serve.evaluate.val_windows' shape of data)."""
    import numpy as np

    from dropless.data.windows import TokenRun, Windows

    return Windows([TokenRun(np.arange(1000) % 256, np.zeros(1, dtype=np.int64))], cfg.train.seq_len)
