"""`dropless bench train` (bench/train_step.py): its two models compute the same loss on the same
batch, so the speed comparison is of the same work, and every row runs a real training step.

Tiny shape (2 layers, d 32, E 8, k 2, f 16, V 64, batch 2 x seq 16), fp32 (no autocast): seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tolerances import BENCH_TRAIN_LOSS, assert_close  # noqa: E402

from dropless.bench import step_profile  # noqa: E402
from dropless.bench import train_step as bt  # noqa: E402


def _hf_ce(bench: bt.Bench) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' loss split into its cross-entropy and its total (balancing loss included)."""
    out = bench.hf(input_ids=bench.tokens_BS, labels=bench.tokens_BS)
    coef = bench.hf.config.router_aux_loss_coef
    return out.loss - coef * out.aux_loss, out.loss


@pytest.mark.parametrize("n_layers", [1, 2])
def test_dropless_and_transformers_compute_the_same_loss(n_layers: int) -> None:
    """The cross-entropy over the same B (S - 1) shifted positions, and with one MoE layer the whole
    loss (the balancing losses agree exactly in math there, hf/mapping.py; with two they agree only
    at balance, so the cross-entropy alone is compared)."""
    shape = bt.Shape(**{**bt.SHAPES["tiny"].__dict__, "n_layers": n_layers})
    bench = bt.build(shape, torch.device("cpu"), "fp32", rows=("dropless", "hf_transformers"))
    assert bench.dtype == "fp32"
    out = bench.model(bench.tokens_BS, bench.targets_BS)
    hf_ce, hf_loss = _hf_ce(bench)
    assert (bench.targets_BS[:, -1] == -100).all() and bench.targets_BS[:, :-1].eq(bench.tokens_BS[:, 1:]).all()
    assert_close(out.ce_loss, hf_ce.detach(), BENCH_TRAIN_LOSS, "cross-entropy")
    if n_layers == 1:
        assert float(out.moe_loss.detach()) > 0  # the balancing loss is really in both totals
        assert_close(out.loss, hf_loss.detach(), BENCH_TRAIN_LOSS, "total loss")


@pytest.mark.slow
def test_every_row_runs_a_training_step() -> None:
    """Each row's timing, and its profile split: MoE and attention time found in both eager rows; the
    compiled row compiled (aot_eager here: the same graphs, eager kernels, seconds; bf16 autocast,
    as grouped_mm traces in bf16 only); transformers ran grouped_mm."""
    rows, meta = bt.run("tiny", torch.device("cpu"), "bf16", steps=1, warmup=0, backend="aot_eager")
    assert [r["variant"] for r in rows] == list(bt.ROWS)
    assert "compile_failed" not in meta and meta["hf_grouped_mm"] is True
    by = {r["variant"]: r for r in rows}
    for name, r in by.items():
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0
        assert 0 < r["optimizer_share"] < 1, name
    for name in ("dropless", "hf_transformers"):
        r = by[name]
        assert r["moe_share"] > 0 and r["attention_share"] > 0, name
        assert r["moe_share"] + r["attention_share"] + r["optimizer_share"] < 1, name
    assert by["dropless_compiled"]["moe_share"] is None and by["dropless_compiled"]["compile_s"] > 0


def test_steps_update_the_weights() -> None:
    """Each row's step changes every parameter of its model (forward, backward and the optimizer ran;
    the compiled row compiled) and leaves no gradient behind."""
    bench = bt.build(bt.SHAPES["tiny"], torch.device("cpu"), "bf16", backend="aot_eager")
    steps = bench.steps()
    for name, step in steps.items():
        model = bench.hf if name == "hf_transformers" else bench.model
        before = [p.detach().clone() for p in model.parameters()]
        step()
        changed = sum(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert changed == len(before), f"{name}: {len(before) - changed} parameters not updated"
        assert all(p.grad is None or not p.grad.any() for p in model.parameters()), f"{name}: grads left"


def test_profile_split_attributes_backward_by_sequence_number() -> None:
    """The backward time of a part is found through the forward ops' sequence numbers: removing that
    link (every backward event unmatched) must lower the MoE share."""
    bench = bt.build(bt.SHAPES["tiny"], torch.device("cpu"), "fp32", rows=("dropless",))
    step = bench.steps()["dropless"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        handles = step_profile.ranges({"moe": bench.model.moe_layers()})
        with torch.profiler.record_function("bench.step"):
            step()
        for h in handles:
            h.remove()
    events = prof.events()
    full = step_profile.split(events, bench.device)["moe"]
    forward_only = sum(e.cpu_time_total for e in events if e.name == "moe")
    total = sum(e.cpu_time_total for e in events if e.name == "bench.step")
    assert full > forward_only / total > 0


def test_bad_arguments_exit_2_and_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "r.json"
    for argv, flag in ((["--shape", "huge"], "--shape"), (["--family", "mixtral"], "--family"),
                       (["--rows", "dropless,foo"], "--rows"), (["--steps", "0"], "--steps"),
                       (["--dtype", "fp16"], "--dtype"), (["--align", "0"], "--align")):
        assert bt.main(argv + ["--json", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dropless bench train: error: ") and flag in err, err
    assert list(tmp_path.iterdir()) == []


def test_json_rows(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert bt.main(["--shape", "tiny", "--dtype", "fp32", "--steps", "1", "--warmup", "0",
                    "--rows", "dropless,hf_transformers", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["rows"]] == ["dropless", "hf_transformers"]
    assert data["meta"]["dtype"] == "fp32" and data["meta"]["shape"] == "tiny"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_align_reaches_the_model_and_keeps_the_loss() -> None:
    """--align pads each expert's rows in the routing plan (padding rows are never read): the same
    loss as transformers' within fp32 noise, and the layers really run with it."""
    bench = bt.build(bt.SHAPES["tiny"], torch.device("cpu"), "fp32", rows=("dropless", "hf_transformers"), align=8)
    assert all(layer.cfg.align == 8 for layer in bench.model.moe_layers())
    hf_ce, _ = _hf_ce(bench)
    assert_close(bench.model(bench.tokens_BS, bench.targets_BS).ce_loss, hf_ce.detach(), BENCH_TRAIN_LOSS, "cross-entropy")
