"""LoRA (train.lora) under expert parallelism and FSDP2 (gloo, CPU): the adapters train as in one
process, the base stays frozen on every rank, and a checkpoint moves between EP layouts expert by
expert.

The routed experts' adapters (a1 [E, D, r], b1 [E, r, W], a2 [E, F, r], b2 [E, r, D]) have the
experts' dim 0: EP keeps each rank's slice of them with its experts, FSDP2 shards that slice over edp,
and the checkpoints store them (and their optimizer state) at the global [E, ...] shape. What could go
wrong silently is an adapter that trains or loads on the wrong expert: rank r's slice multiplied into
another expert's rows. It would still train, to a worse loss. So the moved resume compares every
rank's slice of each adapter and of its optimizer state, row by row, with the rows of the global
tensor the other layout saved (runs/dcp_tensors.py reads them), exactly.

Data layout as test_parallel_train.py: rank r's micro-batch m is one process's micro-batch m * W + r,
so every world sees the global batch of one process with grad_accum 4; what differs is fp32
association (tolerances.PARALLEL_TRAIN_*). The tiny model's block 0 is dense, block 1 MoE with 4
experts: EP 4 puts one expert on each rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dist_harness import run_world
from dropless.layers.lora import EXPERT_ADAPTERS
from dropless.runs import checkpoint as ckpt
from dropless.runs.dcp_tensors import MODEL_PREFIX, OPTIM_STATE_PREFIX, DCPTensors
from dropless.train.loop import Trainer
from tiny_run import rows, tiny as tiny_base
from tolerances import PARALLEL_TRAIN_ADAPTERS, PARALLEL_TRAIN_GRAD_NORM, PARALLEL_TRAIN_LOSS, assert_close

# every kind of adapter the tiny model has (attention, the dense block's MLP, the routed experts) and a
# trained router: the frozen base is then spread over every FSDP unit beside trainable parameters
LORA = ("train.lora.rank=4", 'train.lora.targets=["attn", "dense", "experts", "router"]')
STEPS = 6
E = 4  # tiny_run's model.moe.num_experts
# what trains, spelled out (block 0 dense, block 1 MoE): everything else is the frozen base
TRAINED = sorted([f"blocks.{i}.attn.{m}.lora_{x}" for i in (0, 1) for m in ("qkv", "out") for x in "AB"]
                 + [f"blocks.0.ffn.{m}.lora_{x}" for m in ("gate_up", "down") for x in "AB"]
                 + [f"blocks.1.ffn.experts.{n}" for n in EXPERT_ADAPTERS] + ["blocks.1.ffn.router.weight"])


def tiny(*extra: str):
    return tiny_base(*LORA, "train.dtype=fp32", f"train.steps={STEPS}", "train.eval_every=20",
                     "train.ckpt_every=3", "train.keep_last=5", *extra)


def metric(run_dir: Path, key: str) -> list[float]:
    return [r[key] for r in rows(run_dir, key)]


def max_rel(got: list[float], ref: list[float]) -> float:
    assert len(got) == len(ref)
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def routing(run_dir: Path) -> list[dict]:
    """routing.jsonl's rows without the all-to-all timings (they differ run to run)."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_ms")}
            for line in (run_dir / "routing.jsonl").read_text().splitlines()]


def trained(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint (adapters and router) at their global shape."""
    saved = DCPTensors(path)
    return {k: saved.read(k) for k in saved.specs}


def watch_frozen(trainer: Trainer) -> None:
    """Every step, before the gradients are finished: a gradient on exactly the trainable parameters
    (none on the frozen base, on any rank); the optimizer holds the trainable parameters only."""
    model, real = trainer.model, trainer.layout.finish_grads
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == TRAINED
    train = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == train

    def finish(m, clip):
        for name, p in m.named_parameters():
            assert (p.grad is not None) == p.requires_grad, name
        return real(m, clip)

    trainer.layout.finish_grads = finish


def _train(rank: int, world: int, run_dir: Path, extra: tuple[str, ...]) -> None:
    trainer = Trainer(tiny(*extra), run_dir)
    watch_frozen(trainer)
    trainer.fit()
    train = {id(p) for p in trainer.model.parameters() if p.requires_grad}
    assert {id(p) for p in trainer.optimizer.state} == train  # state for the adapters (and router) alone


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("lora_one") / "one"
    Trainer(tiny("train.grad_accum=4"), run).fit()
    return run


LAYOUTS = {  # world, extra overrides
    # buffered EP with retry: the overflow guard builds the optimizer state eagerly (adapters only)
    "ep2_buffered": (2, ("parallel.ep_size=2", "train.grad_accum=2", "parallel.ep_mode=buffered")),
    "ep4": (4, ("parallel.ep_size=4",)),  # one expert (and its adapters) per rank
    "ep2_edp2": (4, ("parallel.ep_size=2",)),  # FSDP shards each rank's 2 experts' adapters over edp 2
}


@pytest.mark.parametrize("layout", [k if k == "ep2_buffered" else pytest.param(k, marks=pytest.mark.slow)
                                    for k in LAYOUTS])
def test_lora_under_ep_follows_one_process(tmp_path: Path, one: Path, layout: str) -> None:
    world, extra = LAYOUTS[layout]
    run = tmp_path / layout
    run_world(_train, world, tmp_path, run, extra)
    assert len(metric(run, "loss")) == STEPS
    assert max_rel(metric(run, "loss"), metric(one, "loss")) <= PARALLEL_TRAIN_LOSS
    assert max_rel(metric(run, "grad_norm"), metric(one, "grad_norm")) <= PARALLEL_TRAIN_GRAD_NORM
    got, ref = trained(ckpt.latest_checkpoint(run)), trained(ckpt.latest_checkpoint(one))
    assert sorted(got) == sorted(ref) == TRAINED  # adapters-only checkpoints (no buffers in this model)
    adapters = [k for k in got if k.rsplit(".", 1)[-1] in EXPERT_ADAPTERS]
    assert len(adapters) == 4 and all(got[k].shape[0] == E for k in adapters)  # at their global [E, ...]
    for k in ref:
        assert_close(got[k], ref[k], PARALLEL_TRAIN_ADAPTERS, k)


# -- resume at another EP size, and at the same one ----------------------------------------------

class _Stop(Exception):
    pass


def stop_at(trainer: Trainer, step: int) -> None:
    """`trainer.fit()` until it reaches `step` (after the checkpoints before it), like a killed job."""
    real = trainer.train_step

    def stopping(s: int, *args):
        if s == step:
            raise _Stop
        return real(s, *args)

    trainer.train_step = stopping
    with pytest.raises(_Stop):
        trainer.fit()


def same_rows(trainer: Trainer, path: Path, ep: int, rank: int) -> None:
    """Each trainable parameter and its optimizer state as this rank holds it, against the checkpoint
    at `path`: a routed expert's tensors on rows [rank * E/ep, (rank + 1) * E/ep) of the global tensor
    (edp 1: the rank's slice whole), the rest gathered whole; exactly."""
    model, opt = trainer.model, trainer.optimizer
    experts = set(trainer.layout.expert_names)
    saved, state = DCPTensors(path), DCPTensors(path, prefix=OPTIM_STATE_PREFIX)
    L = E // ep
    seen = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert name not in saved.specs, name  # the base is never saved
            continue
        mine = (lambda t: t.to_local()) if name in experts else (lambda t: t.full_tensor())
        rows_of = (lambda t: t[rank * L:(rank + 1) * L]) if name in experts else (lambda t: t)
        assert torch.equal(mine(p.detach()), rows_of(saved.read(name))), name
        for key, v in opt.state[p].items():
            want = state.read(f"{name}.{key}")
            assert torch.equal(mine(v) if v.dim() else v, rows_of(want) if v.dim() else want), (name, key)
        seen += name in experts
    assert seen == 4  # a1, b1, a2, b2 of the one MoE block


def _ep4_to_step_3(rank: int, world: int, run_dir: Path) -> None:
    trainer = Trainer(tiny("parallel.ep_size=4"), run_dir)
    stop_at(trainer, 3)
    same_rows(trainer, ckpt.latest_checkpoint(run_dir), 4, rank)  # what was saved is what each rank held


EP2 = ("parallel.ep_size=2", "train.grad_accum=2")


def _ep2(rank: int, world: int, root: Path) -> None:
    """At EP 2: the uninterrupted run; a run killed at step 4 and resumed from its step-3 checkpoint;
    the EP-4 step-3 checkpoint resumed (checked row by row before it trains)."""
    Trainer(tiny(*EP2), root / "full").fit()
    stop_at(Trainer(tiny(*EP2), root / "killed"), 4)
    Trainer(tiny(*EP2), root / "killed", resume=True).fit()
    moved = Trainer(tiny(*EP2), root / "moved", resume=True)
    assert moved.start_step == 3
    same_rows(moved, ckpt.latest_checkpoint(root / "moved"), 2, rank)
    moved.fit()


@pytest.mark.slow
def test_lora_resumes_at_another_ep_size_expert_by_expert(tmp_path: Path) -> None:
    four = tmp_path / "four"
    run_world(_ep4_to_step_3, 4, tmp_path, four)
    step3 = four / "checkpoints" / ckpt.checkpoint_name(3)
    assert ckpt.latest_checkpoint(four) == step3
    moved = tmp_path / "moved"
    (moved / "checkpoints").mkdir(parents=True)
    shutil.copytree(step3, moved / "checkpoints" / step3.name)
    shutil.copy(four / "metrics.jsonl", moved / "metrics.jsonl")
    run_world(_ep2, 2, tmp_path, tmp_path)

    full, killed = tmp_path / "full", tmp_path / "killed"
    # the same world: bit for bit (losses, routing rows, adapters and their optimizer state)
    assert rows(killed, "loss") == rows(full, "loss")
    assert routing(killed) == routing(full)
    end_full, end_killed = ckpt.latest_checkpoint(full), ckpt.latest_checkpoint(killed)
    for prefix in (MODEL_PREFIX, OPTIM_STATE_PREFIX):
        a, b = DCPTensors(end_full, prefix), DCPTensors(end_killed, prefix)
        assert a.specs == b.specs and all(torch.equal(a.read(k), b.read(k)) for k in a.specs), prefix

    # moved from EP 4 to EP 2: the continuation follows the uninterrupted EP-2 run at the fp32 floor
    cont = [r for r in rows(moved, "loss") if r["step"] >= 3]
    ref = [r for r in rows(full, "loss") if r["step"] >= 3]
    assert [r["step"] for r in cont] == [3, 4, 5]
    assert max_rel([r["loss"] for r in cont], [r["loss"] for r in ref]) <= PARALLEL_TRAIN_LOSS
    got, want = trained(ckpt.latest_checkpoint(moved)), trained(end_full)
    for k in want:
        assert_close(got[k], want[k], PARALLEL_TRAIN_ADAPTERS, k)
