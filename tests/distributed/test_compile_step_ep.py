"""The whole step compiled across processes: `train.compile = "step"` with expert parallelism on 2 gloo
ranks, in the replicated layout (`parallel.fsdp = false`, distributed/replicated.py) with the
capturable buffered EP layer (`parallel.ep_capturable`).

One world trains the tiny config four ways: FSDP2 eager (the default layout), replicated eager,
replicated compiled (backend aot_eager: the tracing is what is tested), and the replicated run
resumed from the FSDP2 run's checkpoint (and the other way round). What must hold:
- replicated eager follows FSDP2 eager at the data-parallel noise floor (PARALLEL_TRAIN_LOSS) in the
  loss and the gradient norm: the same mean gradient, the same norm, the same clipping;
- the compiled run builds its graphs in the first steps and none after (no recompile as the routing
  changes: the buffers are static; links at half the balanced load, so pairs spill every step and the
  second trip's device decision, torch.cond, is in the graph), with no graph break and no fallback
  to eager; its losses follow replicated eager within COMPILED_TRAINING, no pair dropped;
- a checkpoint written in one layout resumes in the other: the next steps' losses follow the run
  that wrote it (the same format, resharded by DCP);
- `train.compile=blocks` compiles the blocks in this layout and evaluates eager (exact-mode dispatch).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from compile_counts import graphs_per_step, reading_backend
from dist_harness import run_world
from dropless.runs import checkpoint as ckpt
from dropless.train import compiling
from dropless.train.loop import Trainer
from tiny_run import rows, tiny
from tolerances import COMPILED_TRAINING, PARALLEL_TRAIN_GRAD_NORM, PARALLEL_TRAIN_LOSS

STEPS, CKPT = 16, 8
WARM_UP = 2  # the first step builds the graphs; the second, the update's with lr as an input
EP = ("parallel.ep_size=2", "parallel.ep_mode=buffered", "parallel.ep_capturable=true", "parallel.on_overflow=spill",
      "parallel.ragged_buffer_factor=0.5", "train.dtype=fp32", "train.optimizer=muon", f"train.steps={STEPS}",
      f"train.eval_every={STEPS}", f"train.ckpt_every={CKPT}")
REPLICATED = (*EP, "parallel.fsdp=false")


def _compiled(rank: int, run_dir: Path) -> list[int]:
    torch._dynamo.reset()
    counters.clear()
    reads: list[str] = []
    compiling.BACKENDS["aot_eager"] = reading_backend(reads)  # (this spawned process only)
    trainer = Trainer(tiny(*REPLICATED, "train.compile=step", "train.compile_backend=aot_eager"), run_dir)
    seen = graphs_per_step(trainer)
    # the one host read in the step's graphs: dynamo turns the learning rate, a Python float that
    # changes every step, into a CPU scalar input read back with `item` (the update's graph); the
    # model's graph (EP exchanges and the spill's decision included) and the norm's hold none
    assert reads and all(r.startswith("item(") and "_lr_" in r for r in reads), reads
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert trainer.step_fns.grad_norm.failed is None and trainer.step_fns.update.failed is None
    assert trainer.compiled is trainer.step_fns.model_graph and trainer.compiled.failed is None
    return seen


def _resumed(src: Path, dst: Path) -> Path:
    """A run folder holding only `src`'s step-CKPT checkpoint (and its metrics up to it)."""
    step = src / "checkpoints" / ckpt.checkpoint_name(CKPT)
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(step, dst / "checkpoints" / step.name)
    return dst


def _worker(rank: int, world: int, root: Path) -> None:
    Trainer(tiny(*EP), root / "fsdp").fit()
    Trainer(tiny(*REPLICATED), root / "replicated").fit()
    seen = _compiled(rank, root / "step")
    if rank == 0:
        (root / "graphs.json").write_text(json.dumps(seen))
        _resumed(root / "fsdp", root / "fsdp_to_replicated")
        _resumed(root / "replicated", root / "replicated_to_fsdp")
    torch.distributed.barrier()
    Trainer(tiny(*REPLICATED), root / "fsdp_to_replicated", resume=True).fit()
    Trainer(tiny(*EP), root / "replicated_to_fsdp", resume=True).fit()
    # train.compile=blocks in the same layout: the blocks really compile (no FSDP2 hook to fall back
    # on), and evaluation, whose exact-mode dispatch reads sizes on the host, runs eager
    blocks = Trainer(tiny(*REPLICATED, "train.compile=blocks", "train.compile_backend=aot_eager", "train.steps=4",
                          "train.eval_every=2"), root / "blocks")
    with warnings.catch_warnings():
        warnings.simplefilter("error", compiling.CompileFallback)
        blocks.fit()
    assert blocks.compiled is not None and blocks.compiled.failed is None


def _metric(run_dir: Path, key: str) -> list[float]:
    return [r[key] for r in rows(run_dir, key)]


def _max_rel(got: list[float], ref: list[float]) -> float:
    assert len(got) == len(ref) > 0
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def test_whole_ep_step_compiles_once_and_follows_eager(tmp_path: Path) -> None:
    run_world(_worker, 2, tmp_path, tmp_path)
    fsdp, repl, step = (_metric(tmp_path / d, "loss") for d in ("fsdp", "replicated", "step"))
    assert len(fsdp) == len(repl) == len(step) == STEPS
    assert _max_rel(repl, fsdp) <= PARALLEL_TRAIN_LOSS
    assert _max_rel(_metric(tmp_path / "replicated", "grad_norm"),
                    _metric(tmp_path / "fsdp", "grad_norm")) <= PARALLEL_TRAIN_GRAD_NORM
    assert _max_rel(step, repl) <= COMPILED_TRAINING
    assert _max_rel(_metric(tmp_path / "step", "val_loss"), _metric(tmp_path / "replicated", "val_loss")) \
        <= COMPILED_TRAINING
    spilled = _metric(tmp_path / "step", "ep_pairs_spilled")
    assert len(spilled) == 2 and min(spilled) > 0, spilled  # the overflow checks at steps 7 and 15
    assert max(_metric(tmp_path / "step", "pairs_dropped")) == 0
    seen = json.loads((tmp_path / "graphs.json").read_text())
    assert len(seen) == STEPS and seen[0] >= 3, seen  # the model's, the norm's, the update's
    assert seen[WARM_UP - 1] == seen[-1], seen  # built in the warm-up, never again
    # a checkpoint of either layout resumes in the other
    assert _max_rel(_metric(tmp_path / "fsdp_to_replicated", "loss"), fsdp[CKPT:]) <= PARALLEL_TRAIN_LOSS
    assert _max_rel(_metric(tmp_path / "replicated_to_fsdp", "loss"), repl[CKPT:]) <= PARALLEL_TRAIN_LOSS


def _edp_worker(rank: int, world: int, root: Path) -> None:
    extra = ("parallel.ep_size=2", "train.dtype=fp32", "train.steps=6", "train.eval_every=6", "train.ckpt_every=6")
    Trainer(tiny(*extra), root / "fsdp").fit()
    Trainer(tiny(*extra, "parallel.fsdp=false"), root / "replicated").fit()


def test_replicated_layout_with_expert_data_parallel(tmp_path: Path) -> None:
    """4 ranks as EP 2 x edp 2: the expert gradients also summed over edp (replicated.py)."""
    run_world(_edp_worker, 4, tmp_path, tmp_path)
    for key, tol in (("loss", PARALLEL_TRAIN_LOSS), ("grad_norm", PARALLEL_TRAIN_GRAD_NORM)):
        got, ref = _metric(tmp_path / "replicated", key), _metric(tmp_path / "fsdp", key)
        assert len(got) == 6 and _max_rel(got, ref) <= tol, (key, got, ref)
