"""`train.compile = true` / "blocks" (train/compiling.py): compiled training follows eager training, and where
the backend cannot compile the run falls back to eager with one warning.

The fast tests compile with backend "aot_eager": dynamo traces each block as one graph (fullgraph) and
AOTAutograd splits forward and backward, as with inductor, but the graphs run torch's eager kernels
(seconds instead of inductor's C++ build). The inductor run of the same check is marked slow.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tiny_run import rows, tiny
from tolerances import COMPILED_TRAINING, INDUCTOR_TRAINING

from dropless.train import compiling
from dropless.train.loop import Trainer

FIVE = ("train.steps=5", "train.warmup_steps=1", "train.eval_every=5", "train.ckpt_every=5",
        "train.dtype=bf16")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    # Every Block shares one code object (Block.forward), and dynamo keeps at most 8 compiled entries
    # per code object in a process: after the suite's other compile tests (other widths, other models)
    # a fullgraph compile here would hit that limit and fall back. A user's run compiles one model.
    torch._dynamo.reset()


def _losses(run_dir: Path, *extra: str) -> tuple[list[float], float, Trainer]:
    trainer = Trainer(tiny(*FIVE, *extra), run_dir)
    summary = trainer.fit()
    return [r["loss"] for r in rows(run_dir, "loss")], summary["final_val_loss"], trainer


def _check_agree(tmp_path: Path, tol: float, *extra: str) -> None:
    eager, eager_val, _ = _losses(tmp_path / "eager", *extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error", compiling.CompileFallback)  # a fallback would compare eager with eager
        compiled, compiled_val, trainer = _losses(tmp_path / "compiled", "train.compile=true", *extra)
    assert trainer.compiled is not None and trainer.compiled.failed is None
    assert len(eager) == len(compiled) == 5
    for step, (a, b) in enumerate(zip(compiled, eager)):
        assert abs(a - b) <= tol * abs(b), f"step {step}: compiled loss {a} vs eager {b}"
    assert abs(compiled_val - eager_val) <= tol * abs(eager_val)


def test_compiled_training_follows_eager_over_five_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(compiling.BACKENDS, "inductor", "aot_eager")
    _check_agree(tmp_path, COMPILED_TRAINING)


@pytest.mark.slow
def test_inductor_training_follows_eager_over_five_steps(tmp_path: Path) -> None:
    """The real backend (C++ kernels): a minute or more of compile on 2 cores."""
    if compiling.compiler_problem(torch.device("cpu"), "inductor") is not None:
        pytest.skip("no C++ compiler for inductor")
    _check_agree(tmp_path, INDUCTOR_TRAINING)


def _fallback_run(tmp_path: Path, *extra: str) -> tuple[list[float], Trainer, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _, trainer = _losses(tmp_path / "fallback", "train.compile=true", *extra)
    return losses, trainer, [w for w in caught if issubclass(w.category, compiling.CompileFallback)]


def test_no_cpp_compiler_falls_back_to_eager_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import cpp_builder, exc

    def missing() -> str:
        raise exc.InvalidCxxCompiler()

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    losses, trainer, fallback = _fallback_run(tmp_path)
    assert trainer.compiled is None
    assert len(fallback) == 1 and "C++ compiler" in str(fallback[0].message), [str(w.message) for w in fallback]
    eager, _, _ = _losses(tmp_path / "eager")
    assert losses == eager  # the same eager path: bit-identical


def test_failure_at_the_first_step_falls_back_to_eager_with_one_warning(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that fails when asked to compile (as inductor does when its C++ build fails)."""
    calls = []

    def broken(gm: torch.fx.GraphModule, example_inputs: list) -> None:
        calls.append(1)
        raise RuntimeError("simulated: C++ compile failed")

    monkeypatch.setitem(compiling.BACKENDS, "inductor", broken)
    losses, trainer, fallback = _fallback_run(tmp_path)
    assert calls, "the backend was never asked to compile"
    assert trainer.compiled is not None and "simulated" in trainer.compiled.failed
    assert len(fallback) == 1 and "first compiled call failed" in str(fallback[0].message)
    eager, _, _ = _losses(tmp_path / "eager")
    assert losses == eager


def test_fp32_compiled_training_follows_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 experts trace through ops/grouped_mm_op.py (torch's own op traces bf16 only)."""
    monkeypatch.setitem(compiling.BACKENDS, "inductor", "aot_eager")
    _check_agree(tmp_path, COMPILED_TRAINING, "train.dtype=fp32")


def test_compiled_state_dict_keys_are_eager_keys() -> None:
    from dropless.config import load_config
    from dropless.model import MoEModel

    cfg = load_config(None, ["model.d_model=32", "model.n_layers=2", "model.n_heads=2"]).model
    model = MoEModel(cfg)
    keys = list(model.state_dict())
    compiling.compile_blocks(model, torch.device("cpu"), "aot_eager")
    assert list(model.state_dict()) == keys


def test_block_compiles_fullgraph_with_more_rows_than_one_activation_block() -> None:
    """The lean experts' backward recomputes the activation in blocks of _GRAIN / F rows when there
    are more rows than that (ops/lean_experts.py); deciding it asks torch.get_num_threads(), which
    dynamo cannot trace. The tiny runs above never reach it (T*K <= one block): here T*K = 2 * 1100 >
    32768 / 16, so fullgraph compile of the block (forward and backward) must still succeed."""
    from dropless.config import load_config
    from dropless.model import MoEModel
    from dropless.ops import lean_experts

    cfg = load_config(None, ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=1100",
                             "model.n_dense_layers=0", "model.moe.num_experts=4", "model.moe.top_k=2",
                             "model.moe.d_expert=16"]).model
    assert 1100 * 2 > lean_experts._GRAIN // 16
    torch.manual_seed(0)
    model = MoEModel(cfg)
    compiled = compiling.compile_blocks(model, torch.device("cpu"), "aot_eager")
    x = torch.randint(0, cfg.vocab_size, (1, 1100))
    with warnings.catch_warnings():
        warnings.simplefilter("error", compiling.CompileFallback)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, x).loss
        loss.backward()
    assert compiled is not None and compiled.failed is None


def test_a_second_compiled_run_in_one_process_still_sees_its_routers(tmp_path: Path) -> None:
    """Two runs one after the other in one process (a notebook, the matrix's stages): dynamo reuses
    the first run's block graphs for the second model, and those graphs do not call the forward hooks
    the routing monitor's probe puts on the routers, so the probe saw no router input and the first
    log step failed. The probe runs eager (health.py)."""
    extra = ("train.compile=blocks", "train.compile_backend=aot_eager", "train.steps=3", "train.eval_every=3")
    for name in ("first", "second"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", compiling.CompileFallback)
            trainer = Trainer(tiny(*extra), tmp_path / name)
            trainer.fit()
        assert trainer.compiled is not None and trainer.compiled.failed is None
        assert len(rows(tmp_path / name, "loss")) == 3
