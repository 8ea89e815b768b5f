"""Hot-expert replication (distributed/ep_replicas.py), world 2, layer level.

Skewed routing (Zipf 1.2 over experts, so rank 0's experts are the busy ones); E=8, k=2, one spare
slot per rank, R=2. Ten AdamW steps, the placement recomputed from the global counts every 4 steps
(weights and moments copied from the owner). After every step each copy must equal its owner bit for
bit (weights and both AdamW moments): the copies' gradients are summed, so the updates are the same.
At every step the replicated layer's output and input gradient must equal the unreplicated EP layer
with the same expert weights at the EP noise floor (an expert's pairs are split over two GEMMs), and
the copy must have received pairs. Also the placement rule itself (pure function).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from dist_harness import run_world
from dropless.bench.ep_scenarios import zipf_ids
from dropless.config import MoEConfig, ParallelConfig
from dropless.distributed import ep_replicas as rep
from dropless.distributed.parallelize_ep import shard_moe_layer
from dropless.layers.moe import MoELayer
from tolerances import EP_REDUCED, assert_close

T, E, K, D = 48, 8, 2, 8


def test_plan_replicas_balances_the_two_ranks() -> None:
    # rank 0 holds 300 of 400 pairs; its busiest expert (200) moves half the gap (100) to rank 1
    reps = rep.plan_replicas([200, 50, 30, 20, 40, 30, 20, 10], 2, 2, 1)
    assert reps == (rep.Replica(0, 1, 0, 0.5),)  # the second copy finds no free slot off its owner
    assert rep.plan_replicas([0] * 8, 2, 2, 1) == ()


def _same_as_owner(layer: MoELayer, opt: torch.optim.Optimizer, rank: int) -> None:
    disp = layer.dispatcher
    L = disp.slots.local
    for r in disp.replicas:
        for name in rep.WEIGHTS:
            p = getattr(layer.experts, name)
            for t in (p.data, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]):
                buf = t[r.expert % L].clone() if rank == r.expert // L else torch.empty_like(t[0])
                dist.broadcast(buf, r.expert // L)
                if rank == r.rank:
                    assert torch.equal(t[L + r.slot], buf), (name, r)


def _worker(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    ref = MoELayer(D, MoEConfig(num_experts=E, top_k=K, d_expert=6))
    layer = rep.replicate_layer(shard_moe_layer(copy.deepcopy(ref), None, ParallelConfig(ep_size=world)), None, 1)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=False)
    L = E // world
    seen: dict[str, torch.Tensor] = {}
    layer.experts.register_forward_pre_hook(lambda m, args: seen.update(offsets=args[0].offsets_E.clone()))
    copies_used = 0
    for step in range(10):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, g = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
        ids = zipf_ids(T, E, K, 1.2, gen)
        if step % 4 == 0:
            counts = torch.bincount(ids.reshape(-1), minlength=E)
            dist.all_reduce(counts)
            cost = rep.apply_placement(layer, rep.plan_replicas(counts.tolist(), 2, world, 1), None, opt)
            assert cost["replicas"] and cost["bytes_broadcast"] > 0, cost
        # the unreplicated EP layer with this layer's own expert weights
        plain = shard_moe_layer(copy.deepcopy(ref), None, ParallelConfig(ep_size=world))
        with torch.no_grad():
            for name in rep.WEIGHTS:
                getattr(plain.experts, name).copy_(getattr(layer.experts, name)[:L])
            for a, b in zip(plain.router.parameters(), layer.router.parameters()):
                a.copy_(b)
        outs = []
        for m in (layer, plain):
            xs = x.clone().requires_grad_(True)
            y = m(xs, replay_ids=ids).y
            (y * g).sum().backward()
            outs.append((y.detach(), xs.grad))
        offsets = seen["offsets"].long()
        copies_used += int(offsets[L] - offsets[L - 1])  # rows in this rank's spare slot
        assert_close(outs[0][0], outs[1][0], EP_REDUCED, msg=f"step {step} y")
        assert_close(outs[0][1], outs[1][1], EP_REDUCED, msg=f"step {step} dx")
        rep.sync_replica_grads(layer, None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _same_as_owner(layer, opt, rank)
    used = torch.tensor(copies_used)
    dist.all_reduce(used)
    assert int(used) > 0  # the copies did compute pairs


def test_replicas_stay_identical_and_match_the_plain_layer(tmp_path: Path) -> None:
    run_world(_worker, 2, tmp_path)
