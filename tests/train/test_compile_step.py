"""`train.compile = "step"` (train/compile_step.py): the whole model, the gradient norm and the update
compiled; one set of graphs for the run, whatever the routing does.

Backend "aot_eager" (dynamo and AOTAutograd trace what inductor would get, eager kernels run them):
what these tests guard is the tracing (no graph break, no recompile), which the backend does not
change; the inductor run is marked slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from compile_counts import graphs_per_step
from tiny_run import rows, tiny
from tolerances import COMPILED_TRAINING, INDUCTOR_TRAINING

from dropless.layers.moe import MoELayer
from dropless.train import compiling
from dropless.train.loop import Trainer
from dropless.train.muon import Muon

WARM_UP = 2  # the first step builds every graph; the second, the update's graph with lr as an input


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()  # other tests' graphs count against dynamo's per-code-object cache
    counters.clear()


def _trainer(run_dir: Path, *extra: str) -> Trainer:
    return Trainer(tiny("train.compile=step", *extra), run_dir)


@pytest.mark.parametrize("dtype,optimizer", [("fp32", "muon"), pytest.param("bf16", "adamw", marks=pytest.mark.slow)])
def test_200_steps_build_their_graphs_once(tmp_path: Path, dtype: str, optimizer: str) -> None:
    """200 steps of changing routing (new batches, moving weights, the expert counts of every layer
    different each step), log steps and evaluations among them: every graph is built in the first
    steps (the model's for plain and for log steps, the norm's, the update's) and none after;
    no graph break anywhere."""
    trainer = _trainer(tmp_path, f"train.dtype={dtype}", f"train.optimizer={optimizer}", "train.steps=200",
                       "train.eval_every=100", "train.ckpt_every=100", "log.log_every=25",
                       "train.compile_backend=aot_eager")
    assert trainer.step_fns.update.backend == "aot_eager"
    seen = graphs_per_step(trainer)
    assert len(seen) == 200
    assert seen[WARM_UP - 1] == seen[-1] == 5, seen[:WARM_UP + 3]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert trainer.step_fns.grad_norm.failed is None and trainer.step_fns.update.failed is None
    assert trainer.compiled is trainer.step_fns.model_graph and trainer.compiled.failed is None
    assert isinstance(trainer.optimizer, Muon)  # adamw under "step": Muon's AdamW half (optim.py)
    losses = [r["ce_loss"] for r in rows(tmp_path, "loss")]
    assert losses[-1] < losses[0] - 1.0


def test_an_injected_graph_break_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails on a graph break: the fullgraph compile of the model refuses it and the
    run would fall back to eager with a warning, which the check turns into an error."""
    monkeypatch.setitem(compiling.BACKENDS, "inductor", "aot_eager")
    real = MoELayer._stats

    def with_break(self, *args):
        torch._dynamo.graph_break()
        return real(self, *args)

    monkeypatch.setattr(MoELayer, "_stats", with_break)
    with pytest.raises(compiling.CompileFallback, match="train.compile=step"):
        graphs_per_step(_trainer(tmp_path, "train.steps=3"))


@pytest.mark.slow
def test_a_recompile_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """... and on a recompile: a Python value the model's graph reads that changes every step (a
    string: dynamo guards on its value) builds a new graph each step."""
    monkeypatch.setitem(compiling.BACKENDS, "inductor", "aot_eager")
    tag = {"step": "0"}
    real_stats = MoELayer._stats

    def stats_reading_a_string(self, *args):
        out = real_stats(self, *args)
        return out if tag["step"] != "never" else None

    monkeypatch.setattr(MoELayer, "_stats", stats_reading_a_string)
    trainer = _trainer(tmp_path, "train.steps=4")
    real = trainer.train_step

    def tagged(step: int, log_step: bool = False):
        tag["step"] = str(step)
        return real(step, log_step)

    trainer.train_step = tagged  # type: ignore[method-assign]
    seen = graphs_per_step(trainer)
    assert seen[-1] > seen[WARM_UP - 1]


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_compiled_step_follows_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    monkeypatch.setitem(compiling.BACKENDS, "inductor", "aot_eager")
    extra = (f"train.dtype={dtype}", "train.optimizer=muon", "train.steps=5", "train.eval_every=5")
    Trainer(tiny(*extra), tmp_path / "eager").fit()
    graphs_per_step(_trainer(tmp_path / "step", *extra))
    eager, step = rows(tmp_path / "eager", "loss"), rows(tmp_path / "step", "loss")
    assert len(eager) == len(step) == 5
    for a, b in zip(step, eager):
        assert abs(a["loss"] - b["loss"]) <= COMPILED_TRAINING * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    (ve,), (vs,) = rows(tmp_path / "eager", "val_loss"), rows(tmp_path / "step", "val_loss")
    assert abs(vs["val_loss"] - ve["val_loss"]) <= COMPILED_TRAINING * ve["val_loss"]


@pytest.mark.slow
def test_inductor_step_follows_eager(tmp_path: Path) -> None:
    if compiling.compiler_problem(torch.device("cpu"), "inductor") is not None:
        # inductor's CPU kernels are C++ built at run time: without a compiler there is nothing to test
        # (the run itself would fall back to eager with a warning, test_compile_train.py checks that)
        pytest.skip("no C++ compiler for inductor")
    extra = ("train.dtype=bf16", "train.optimizer=muon", "train.steps=5", "train.eval_every=5")
    Trainer(tiny(*extra), tmp_path / "eager").fit()
    graphs_per_step(_trainer(tmp_path / "step", *extra))
    for a, b in zip(rows(tmp_path / "step", "loss"), rows(tmp_path / "eager", "loss")):
        assert abs(a["loss"] - b["loss"]) <= INDUCTOR_TRAINING * abs(b["loss"])


def test_cuda_graphs_refused_off_cuda_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train.cuda_graphs=true.*'cpu'"):
        _trainer(tmp_path / "run", "train.cuda_graphs=true")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="train.cuda_graphs=true.*train.compile=step"):
        tiny("train.cuda_graphs=true")


def test_several_processes_are_refused_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Across processes the whole step compiles only without FSDP2 and, with EP, on the capturable
    layer (tests/distributed/test_compile_step_ep.py runs it): EP in the config, or --nproc > 1 at
    the launcher, refused otherwise, naming the fields to set."""
    with pytest.raises(ValueError, match="train.compile='step': with parallel.ep_size=2.*parallel.fsdp=false.*"
                                         r"got parallel.fsdp=true, parallel.ep_capturable=false"):
        tiny("train.compile=step", "parallel.ep_size=2")
    buffered = ("parallel.ep_size=2", "parallel.ep_mode=buffered", "parallel.ep_capturable=true")
    with pytest.raises(ValueError, match="got parallel.fsdp=true, parallel.ep_capturable=true"):
        tiny("train.compile=step", *buffered)
    tiny("train.compile=step", *buffered, "parallel.fsdp=false")  # accepted
    with pytest.raises(ValueError, match="parallel.fsdp=False: with parallel.pp_size=2"):
        tiny("parallel.fsdp=false", "parallel.pp_size=2")
    from dropless.train import run

    assert run.main(["--nproc", "2", "--run-dir", str(tmp_path / "run"), "--set", "train.compile=step"]) == 2
    assert "train.compile='step' with --nproc 2" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
