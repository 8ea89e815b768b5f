"""Hot-expert replication in the trainer (train/ep_replicas_train.py, HotReplicaDispatcher), world 2.

Layer level (E=8, k=2, one spare slot per rank, R=2, Zipf 1.2 routing so rank 0's experts are the
busy ones; ten AdamW steps in exact mode and five in buffered mode (de-dup, worst-case links), the
placement recomputed from the global counts every 4 steps; buffered steps must not read the host):
- the copy a rank computes with is its owner's weight bit for bit at every step (the fetched spare
  group against the owner's parameter, broadcast from the owner);
- output, input gradient, router gradient and the expert gradients equal the unreplicated EP layer
  with the same weights at the EP noise floor (an expert's pairs are split over two GEMMs, its
  gradient summed from two parts), and so does `detailed_stats`' per-expert output sum;
- the copies computed pairs.
Trainer (tiny model, EP 2, fp32, bias-skewed routing, R=1 placed every 2 steps, 10 steps): losses and
gradient norms follow the unreplicated trainer's (a copy counted twice in the norm would not), the
placement rows report copies; a checkpoint written with replicas resumes without them (and the other
way) to the same next loss as the run that goes on.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_world
from host_sync import EP_EXACT_SPLIT_SIZES, forbid_host_sync
from dropless.bench.ep_scenarios import zipf_ids
from dropless.config import MoEConfig, ParallelConfig
from dropless.distributed import ep_replicas as rep
from dropless.distributed.ep_hot_replicas import HotReplicaDispatcher
from dropless.distributed.parallelize_ep import shard_moe_layer
from dropless.layers.moe import MoELayer
from dropless.train.loop import Trainer
from tiny_run import tiny
from tolerances import EP_REDUCED, PARALLEL_TRAIN_GRAD_NORM, PARALLEL_TRAIN_LOSS, assert_close

T, E, K, D = 48, 8, 2, 8


def _copies_are_owners(layer: MoELayer, rank: int) -> None:
    disp, ex = layer.dispatcher, layer.experts
    L = disp.slots.local
    grown = disp.grow(ex.w_gate_up_EDF.detach(), ex.w_down_EFD.detach())
    for r in disp.replicas:
        for w, g in zip((ex.w_gate_up_EDF, ex.w_down_EFD), grown):
            buf = w[r.expert % L].detach().clone() if rank == r.expert // L else torch.empty_like(w[0])
            dist.broadcast(buf, r.expert // L)
            if rank == r.rank:
                assert torch.equal(g[L + r.slot], buf), r


def _layer_case(rank: int, world: int, mode: str, steps: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    ref = MoELayer(D, MoEConfig(num_experts=E, top_k=K, d_expert=6))
    pcfg = ParallelConfig(ep_size=world, ep_mode=mode, ragged_buffer_factor=-1, max_tokens_per_rank=T)
    layer = shard_moe_layer(copy.deepcopy(ref), None, pcfg)
    layer.slots = layer.slots.with_spare(1)
    layer.dispatcher = HotReplicaDispatcher.wrap(layer.dispatcher, layer.slots)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=False)
    L = E // world
    seen: dict[str, torch.Tensor] = {}
    layer.experts.register_forward_pre_hook(lambda m, args: seen.update(offsets=args[0].offsets_E.clone()))
    copies_used = 0
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, g = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
        ids = zipf_ids(T, E, K, 1.2, gen)
        if step % 4 == 0:
            counts = torch.bincount(ids.reshape(-1), minlength=E)
            dist.all_reduce(counts)
            layer.dispatcher.set_replicas(rep.plan_replicas(counts.tolist(), 2, world, 1), x.device)
            assert layer.dispatcher.replicas
        _copies_are_owners(layer, rank)
        plain = shard_moe_layer(copy.deepcopy(ref), None, pcfg)
        plain.load_state_dict(layer.state_dict())  # the same weights (the copies are not parameters)
        outs = []
        for m in (layer, plain):
            m.detailed_stats = True
            xs = x.clone().requires_grad_(True)
            with forbid_host_sync(f"{mode} EP with replicas read the host",
                                  () if mode == "buffered" else (EP_EXACT_SPLIT_SIZES,)):
                out = m(xs, replay_ids=ids)
                (out.y * g).sum().backward()
            out_sq = out.stats.out_sq_E.clone()  # per rank: its groups' rows; summed, every expert's
            dist.all_reduce(out_sq)
            outs.append([out.y.detach(), xs.grad, out_sq] + [p.grad for p in m.parameters()])
        offsets = seen["offsets"].long()
        copies_used += int(offsets[L] - offsets[L - 1])  # rows in this rank's spare slot
        for i, (a, b) in enumerate(zip(*outs)):
            assert_close(a, b, EP_REDUCED, msg=f"{mode} step {step} tensor {i}")
        opt.step()
        opt.zero_grad(set_to_none=True)
    used = torch.tensor(copies_used)
    dist.all_reduce(used)
    assert int(used) > 0  # the copies did compute pairs


BASE = ("model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0", "parallel.ep_size=2",
        "train.dtype=fp32", "train.steps=10", "train.ckpt_every=1000")
REPL = ("parallel.replicate_hot_experts=1", "parallel.replica_interval=2")


def _trainer(root: Path, name: str, extra: tuple[str, ...], resume: bool = False) -> Trainer:
    trainer = Trainer(tiny(*BASE, *extra), root / name, resume=resume)
    for layer in trainer.model.moe_layers():
        layer.router.set_bias(torch.tensor([1.0, 0.5, 0.0, 0.0]))  # rank 0's experts are the hot ones
    return trainer


def _run(trainer: Trainer, steps: range) -> tuple[list[float], list[float], list[dict]]:
    losses, norms, rows = [], [], []
    for step in steps:
        sums, norm = trainer.train_step(step)
        losses.append(float(sums.loss))
        norms.append(float(norm))
        if trainer.layout.replicas is not None and (row := trainer.layout.replicas.maybe_place(step)) is not None:
            rows.append(row)
    return losses, norms, rows


def _trainer_case(rank: int, world: int, root: Path) -> None:
    plain, rep_t = _trainer(root, "plain", ()), _trainer(root, "rep", REPL)
    assert plain.layout.replicas is None and rep_t.layout.replicas is not None
    a, b = _run(plain, range(6)), _run(rep_t, range(6))
    assert len(b[2]) == 3 and all(r["replica_placement"][0] for r in b[2]), b[2]
    assert b[2][-1]["busiest_over_mean_planned"][0] < b[2][-1]["busiest_over_mean_before"][0], b[2]
    assert b[2][-1]["replica_fetch_bytes_per_step"] > 0
    for la, lb, na, nb in zip(a[0], b[0], a[1], b[1]):
        assert abs(la - lb) <= PARALLEL_TRAIN_LOSS * abs(la), (a, b)
        assert abs(na - nb) <= PARALLEL_TRAIN_GRAD_NORM * abs(na), (a, b)
    # evaluation (exact dispatch, the subclass kept) sees the same model
    va, vb = plain.evaluate(), rep_t.evaluate()
    assert abs(va - vb) <= PARALLEL_TRAIN_LOSS * abs(va), (va, vb)
    # a checkpoint of the replicated run resumes without replicas, and the plain one with them
    rep_t.save(6)
    plain.save(6)
    dist.barrier()
    go_on = _run(rep_t, range(6, 8))[0]
    for name, extra in (("rep", ()), ("plain", REPL)):
        resumed = _trainer(root, name, extra, resume=True)
        assert resumed.start_step == 6
        got = _run(resumed, range(6, 8))[0]
        for x, y in zip(got, go_on):
            assert abs(x - y) <= PARALLEL_TRAIN_LOSS * abs(y), (name, got, go_on)


def _worker(rank: int, world: int, root: Path) -> None:
    _layer_case(rank, world, "exact", 10)
    _layer_case(rank, world, "buffered", 5)  # worst-case links: the virtual slots' capacity
    _trainer_case(rank, world, root)


@pytest.mark.slow
def test_replicas_in_training(tmp_path: Path) -> None:
    run_world(_worker, 2, tmp_path, tmp_path)


def test_replica_config() -> None:
    with pytest.raises(ValueError, match="parallel.replicate_hot_experts"):
        ParallelConfig(replicate_hot_experts=-1)
    with pytest.raises(ValueError, match="parallel.replica_interval"):
        ParallelConfig(replica_interval=0)
    with pytest.raises(ValueError, match="parallel.replicate_hot_experts"):
        tiny("parallel.replicate_hot_experts=1")  # ep_size 1
