"""`dropless train` with pipeline stages (parallel.pp_size=2, 2 gloo ranks) against one process: every
logged loss, gradient norm and validation loss, the routing record of every layer, and checkpoints
that resume across the layouts (pp 2 -> one process, one process -> pp 2); the same with
multi-token prediction.

One schedule call of a whole micro-batch (gpipe, pp_microbatches=1) computes each balancing loss on the
rows one process computes it on, so the two runs are the same computation up to fp32 association
(tests/tolerances.py PARALLEL_TRAIN_*). The pipeline's own exactness over several micro-batches, every
schedule, edp and ep is tests/distributed/test_pipeline.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dist_harness import run_world
from dropless.runs import checkpoint as ckpt
from dropless.train import run
from dropless.train.loop import Trainer
from tiny_run import TINY
from tiny_run import tiny as tiny_base
from tolerances import PARALLEL_TRAIN_GRAD_NORM, PARALLEL_TRAIN_LOSS

PP = ("parallel.pp_size=2", "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=1")


def cfg(*extra: str):
    return tiny_base("train.dtype=fp32", "model.n_layers=4", "model.n_dense_layers=1", "train.steps=6",
                     "train.warmup_steps=1", "train.eval_every=3", "train.ckpt_every=3",
                     "model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0.01",
                     "model.moe.balance.global_aux_loss_coeff=0.01", "train.grad_accum=2", *extra)


def rows(run_dir: Path, key: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if key in r]


def _close(got: list[dict], want: list[dict], key: str, tol: float, label: str = "") -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want], (label, key)
    for g, w in zip(got, want):
        assert abs(g[key] - w[key]) <= tol * abs(w[key]), (label, key, g["step"], g[key], w[key])


def _train(rank: int, world: int, run_dir: Path, extra: tuple[str, ...], resume: bool) -> None:
    Trainer(cfg(*extra), run_dir, resume=resume).fit()


def _from_step3(src: Path, dst: Path) -> Path:
    step3 = src / "checkpoints" / ckpt.checkpoint_name(3)
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(step3, dst / "checkpoints" / step3.name)
    kept = [line for line in (src / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] < 3]
    (dst / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    return dst


@pytest.mark.slow
def test_pipeline_trains_like_one_process_and_resumes_across_layouts(tmp_path: Path) -> None:
    one = tmp_path / "one"
    Trainer(cfg(), one).fit()
    pp = tmp_path / "pp"
    run_world(_train, 2, tmp_path, pp, PP, False)
    for key, tol in (("loss", PARALLEL_TRAIN_LOSS), ("ce_loss", PARALLEL_TRAIN_LOSS),
                     ("moe_loss", PARALLEL_TRAIN_GRAD_NORM), ("grad_norm", PARALLEL_TRAIN_GRAD_NORM),
                     ("val_loss", PARALLEL_TRAIN_LOSS)):
        _close(rows(pp, key), rows(one, key), key, tol)
    # the routing record covers all three MoE layers (one on the first stage's rank, two on the last's)
    routing = [json.loads(line) for line in (pp / "routing.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (one / "routing.jsonl").read_text().splitlines()]
    assert [len(r["layers"]) for r in routing] == [3] * 6
    assert [layer["counts"] for layer in routing[0]["layers"]] == [layer["counts"] for layer in ref[0]["layers"]]

    # pp 2's checkpoint at step 3, resumed in one process and at pp 2; one process's, resumed at pp 2
    a = _from_step3(pp, tmp_path / "pp_to_one")
    Trainer(cfg(), a, resume=True).fit()
    b = _from_step3(one, tmp_path / "one_to_pp")
    run_world(_train, 2, tmp_path, b, PP, True)
    c = _from_step3(pp, tmp_path / "pp_to_pp")
    run_world(_train, 2, tmp_path, c, PP, True)
    for run in (a, b, c):
        _close(rows(run, "loss")[-3:], rows(one, "loss")[-3:], "loss", PARALLEL_TRAIN_LOSS, run.name)
        _close(rows(run, "val_loss")[-1:], rows(one, "val_loss")[-1:], "val_loss", PARALLEL_TRAIN_LOSS, run.name)
        # checkpoints hold rank 0's probe ids (under stages, rank 0's layers only): the first flip rate
        # after a resume that has or had stages is left out, never measured against another layer's ids
        first = json.loads((run / "routing.jsonl").read_text().splitlines()[0])
        assert first["step"] == 3 and [layer["flip_step"] for layer in first["layers"]] == [None] * 3, run.name


# An MoE-block MTP module (its balancing losses, its bias from the training forwards' counts) with
# untied embeddings (the last stage's embedding copy exists for the module alone)
MTP = ("model.mtp_depth=1", "model.mtp_block=moe", "model.moe.balance.global_aux_loss_coeff=0",
       "model.moe.balance.seq_aux_loss_coeff=0.001", "model.tie_embeddings=false")


@pytest.mark.slow
def test_mtp_through_stages_trains_like_one_process_and_resumes_across_layouts(tmp_path: Path) -> None:
    """Multi-token prediction on the last stage through the trainer: every logged loss (the MTP loss
    and the MTP block's balancing losses in `loss` and `moe_loss`, `mtp_loss` apart), the gradient
    norm and the validation loss follow one process; pp 2's checkpoint (the MTP module and the
    embedding's copy under the whole model's names) resumes in one process, and one process's at
    pp 2, on the same losses."""
    one = tmp_path / "one"
    Trainer(cfg(*MTP), one).fit()
    pp = tmp_path / "pp"
    run_world(_train, 2, tmp_path, pp, (*PP, *MTP), False)
    assert len(rows(pp, "mtp_loss")) == len(rows(one, "mtp_loss")) == 6
    for key, tol in (("loss", PARALLEL_TRAIN_LOSS), ("ce_loss", PARALLEL_TRAIN_LOSS), ("mtp_loss", PARALLEL_TRAIN_LOSS),
                     ("moe_loss", PARALLEL_TRAIN_GRAD_NORM), ("grad_norm", PARALLEL_TRAIN_GRAD_NORM),
                     ("val_loss", PARALLEL_TRAIN_LOSS)):
        _close(rows(pp, key), rows(one, key), key, tol)
    a = _from_step3(pp, tmp_path / "pp_to_one")
    Trainer(cfg(*MTP), a, resume=True).fit()
    b = _from_step3(one, tmp_path / "one_to_pp")
    run_world(_train, 2, tmp_path, b, (*PP, *MTP), True)
    for run in (a, b):
        for key in ("loss", "mtp_loss"):
            _close(rows(run, key)[-3:], rows(one, key)[-3:], key, PARALLEL_TRAIN_LOSS, run.name)
        _close(rows(run, "val_loss")[-1:], rows(one, "val_loss")[-1:], "val_loss", PARALLEL_TRAIN_LOSS, run.name)


PACKED = ("data.document_mask=true", "train.steps=3", "model.n_dense_layers=2")  # rank 0: no MoE layer


def _train_packed(rank: int, world: int, run_dir: Path) -> None:
    trainer = Trainer(cfg(*PP, *PACKED), run_dir)
    assert trainer.layout.pipeline.packed  # the stages take and pass on the document ids
    trainer.fit()


@pytest.mark.slow
def test_packed_documents_through_stages(tmp_path: Path) -> None:
    """Document-masked windows through the trainer: the stages take the batches' document ids and pass
    them on (the masking itself against one process, with documents inside every window:
    test_pipeline.py's packed case)."""
    one = tmp_path / "one"
    Trainer(cfg(*PACKED), one).fit()
    pp = tmp_path / "pp"
    run_world(_train_packed, 2, tmp_path, pp)
    for key in ("loss", "val_loss"):
        _close(rows(pp, key), rows(one, key), key, PARALLEL_TRAIN_LOSS)
    # the first stage's rank holds no MoE layer: it still runs the probe, and the record has both layers
    routing = [json.loads(line) for line in (pp / "routing.jsonl").read_text().splitlines()]
    assert [len(r["layers"]) for r in routing] == [2] * 3


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "3", "--set", "parallel.pp_size=2"],
     "parallel.pp_size=2 x parallel.ep_size=1 does not divide the world size 3"),
    (["--set", "parallel.pp_size=2"], "parallel.pp_size=2: pipeline stages need several processes"),
    (["--nproc", "2", "--set", "parallel.pp_size=2", "--set", "train.lora.rank=4", "--set", "train.optimizer=adamw"],
     "train.lora.rank=4: with parallel.pp_size=2: not under pipeline stages yet (LoRA)"),
    (["--nproc", "2", "--set", "parallel.pp_size=2", "--set", "train.compile=blocks"],
     "train.compile='blocks': with parallel.pp_size=2: not under pipeline stages yet"),
    (["--nproc", "2", "--set", "parallel.pp_size=2", "--set", "parallel.pp_microbatches=3"],
     "parallel.pp_microbatches=3: does not divide train.batch_size=4"),
    (["--nproc", "4", "--set", "parallel.pp_size=4", "--set", "parallel.pp_microbatches=2"],
     "parallel.pp_microbatches=2: with parallel.pp_schedule='1f1b' and pp_size=4: 1F1B needs at least"),
    (["--nproc", "2", "--set", "parallel.pp_size=2", "--set", "parallel.pp_layers=[1,1]"],
     "parallel.pp_layers=[1, 1]: covers 2 blocks; the model has model.n_layers=4"),
])
def test_bad_pipelines_are_refused_before_anything_is_written(argv, message, tmp_path, capsys) -> None:
    sets = [a for o in [*TINY, "model.n_layers=4"] for a in ("--set", o)]
    assert run.main(["--run-dir", str(tmp_path / "run"), *sets, *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


ZBV = ("parallel.pp_size=2", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2", "parallel.pp_microbatches=2")


@pytest.mark.slow
def test_zbv_resumes_with_other_parameter_groups_per_rank(tmp_path: Path) -> None:
    """zbv: rank 0 holds the first and the last stage, rank 1 the two middle ones, so their optimizer
    parameter groups differ in size; a resume loads each rank's state by name into its own groups."""
    run = tmp_path / "zbv"
    run_world(_train, 2, tmp_path, run, ZBV, False)
    c = _from_step3(run, tmp_path / "zbv_resumed")
    run_world(_train, 2, tmp_path, c, ZBV, True)
    _close(rows(c, "loss")[-3:], rows(run, "loss")[-3:], "loss", PARALLEL_TRAIN_LOSS, "zbv")
