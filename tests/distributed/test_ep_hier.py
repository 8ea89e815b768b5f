"""Two-level dispatch (parallel.ep_hierarchy = "node", distributed/ep_hier.py) on gloo: 4 ranks as 2
nodes x 2 (and 2 ranks as 2 nodes x 1 and 1 node x 2). Against the single-process layer, every case
of test_ep.py at the EP floor (tolerances.EP_REDUCED), with de-dup on and off inside the node and
with the mxfp8 payload; and the rail trip's bytes to other nodes equal to the distinct (token,
destination node) pairs, which the flat all-to-all's exceed.

Buffered mode (distributed/ep_hier_buffered.py), 4 ranks as 2 nodes x 2 and 2 ranks as 2 nodes of
1: the worst-case blocks (factor -1) match one process with nothing dropped; small blocks (factor
0.3) count their overflow exactly (the pairs the experts computed plus the dropped ones are every
pair, summed over the group) and the guard's flag rises; the same small blocks with on_overflow
"spill" drop nothing and match one process. On the dispatcher directly: each level's count against
a host recount (the rail's from the routing, the node's from the rows that reached the experts),
`worst_case()` never overflowing and equal to `exact()` bit for bit, no host read in a buffered
call (spill: the node group's one read), and the fixed blocks' bytes to other nodes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_world
from dropless.config import ParallelConfig
from dropless.distributed.ep import EPDispatcher, must_invalidate
from dropless.distributed.ep_hier import HierEPDispatcher
from dropless.distributed.ep_hier_buffered import node_hit_fraction, rail_rows
from dropless.distributed.mesh import ep_hier_groups
from dropless.layers.router import RoutingDecision
from dropless.ops import payload
from dropless.train.loop import Trainer
from host_sync import EP_EXACT_SPLIT_SIZES, EP_SPILL_TOTAL, forbid_host_sync
from test_ep import _case_list, _check_parity, _run_case
from tiny_run import tiny
from tolerances import EP_LOWP, EP_REDUCED, PARALLEL_TRAIN_LOSS, assert_close


def _bytes(rank: int, world: int, G: int, hier: tuple) -> None:
    """The rail trip sends one row per (token, other node) its experts reach, plus the routing row."""
    E, K, T, D = 8 * world, 6, 33, 64
    gen = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    dec = RoutingDecision(ids, w, torch.zeros(T, E), torch.zeros(T, E))
    for pl in ("native", "mxfp8"):
        disp = HierEPDispatcher(E, None, dispatch_dtype=pl, node_group=hier[0], rail_group=hier[1], node_size=G)
        _, meta = disp.dispatch(torch.randn(T, D, generator=gen), dec)
        LG, me = E // world * G, rank // G
        nodes = [set((ids[t] // LG).tolist()) - {me} for t in range(T)]
        rb = payload.row_bytes(pl, D, torch.float32)
        assert int(meta.bytes_inter_node) == sum(map(len, nodes)) * (rb + K * 8), (pl, int(meta.bytes_inter_node))
        # the flat all-to-all with de-dup sends a row per (token, rank) on another node: never fewer
        L = E // world
        flat = sum(len({int(e) // L for e in ids[t] if int(e) // LG != me}) for t in range(T))
        assert flat >= sum(map(len, nodes))


def _worker(rank: int, world: int, G: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    hier = ep_hier_groups(world, G, "cpu")
    _bytes(rank, world, G, hier)
    for case in _case_list(world):
        for dedup in (True, False):
            tag = f"world={world} G={G} {case['name']} dedup={dedup}"
            res = _run_case(rank, world, case, "exact", dedup, 2.0, hier=hier, ep_hierarchy="node",
                            ep_node_size=G)
            _check_parity(tag, res, EP_LOWP if case.get("precision") else EP_REDUCED)
            st = res["_stats"]
            assert int(st.pairs_dropped) == 0, tag
            offsets, want = res["_offsets"]
            assert torch.equal(offsets.long(), want), f"{tag} offsets {offsets.tolist()} != {want.tolist()}"
    dist.barrier()


@pytest.mark.parametrize("world,G", [(2, 1), (2, 2), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_two_level_matches_single_process(world: int, G: int, tmp_path: Path) -> None:
    run_world(_worker, world, tmp_path, G)


def _group_sum(*values: torch.Tensor) -> list[int]:
    t = torch.stack([v.long() for v in values])
    dist.all_reduce(t)
    return t.tolist()


def _buffered_worker(rank: int, world: int, G: int) -> None:
    """The layer through buffered two-level dispatch, every test_ep case (module note)."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # a read of unwritten memory shows as NaN
    node = dict(hier=ep_hier_groups(world, G, "cpu"), ep_hierarchy="node", ep_node_size=G)
    dropped_total = spilled_total = 0
    for case in _case_list(world):
        lowp, one_row_per_pair = case.get("precision"), case.get("align", 1) == 1 and not case.get("precision")
        for dedup in (True, False):
            tag = f"world={world} G={G} {case['name']} buffered dedup={dedup}"
            res = _run_case(rank, world, case, "buffered", dedup, -1, **node)
            _check_parity(f"{tag} factor=-1", res, EP_LOWP if lowp else EP_REDUCED)
            assert int(res["_stats"].pairs_dropped) == 0, tag
            got, want = res["_offsets"]
            assert torch.equal(got.long(), want), f"{tag} offsets {got.tolist()} != {want.tolist()}"

            res = _run_case(rank, world, case, "buffered", dedup, 0.3, **node)
            got, want = res["_offsets"]
            dropped, rows, pairs = _group_sum(res["_stats"].pairs_dropped, got[-1], want[-1])
            if one_row_per_pair:  # the experts' rows and the count of the rest make up every pair
                assert rows + dropped == pairs, f"{tag} factor=0.3: {rows} rows + {dropped} dropped != {pairs}"
            assert bool(must_invalidate(torch.tensor(dropped))) == (dropped > 0), tag
            if case.get("force"):  # every token on one rank's experts: the blocks must overflow
                assert dropped > 0, tag
            dropped_total += dropped
            for name, pair in res.items():  # dropped pairs contribute zeros, never NaN
                if not name.startswith("_"):
                    assert torch.isfinite(pair[0]).all(), f"{tag} factor=0.3 {name}"

            if lowp:  # spilled rows join their group after the buffered ones: other 32-row blocks (test_ep_spill)
                continue
            res = _run_case(rank, world, case, "buffered", dedup, 0.3, on_overflow="spill", **node)
            _check_parity(f"{tag} spill", res, EP_REDUCED)
            st = res["_stats"]
            assert int(st.pairs_dropped) == 0 and int(st.pairs_computed) == res["_pairs_ref"], tag
            got, want = res["_offsets"]
            assert torch.equal(got.long(), want), f"{tag} spill offsets {got.tolist()} != {want.tolist()}"
            spilled_total += _group_sum(st.pairs_spilled)[0]
    assert dropped_total > 0 and spilled_total > 0, (dropped_total, spilled_total)
    dist.barrier()


def _levels(rank: int, world: int, G: int, hier: tuple) -> None:
    """Each level's overflow on the dispatcher, the retry and exact variants, host reads, bytes."""
    Nn, E, K, T, D = world // G, 8 * world, 2, 24, 16
    L, LG = E // world, E // Nn
    gen = torch.Generator().manual_seed(10 + rank)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    ids[: T // 2] = torch.stack([torch.randperm(LG, generator=gen)[:K] for _ in range(T // 2)])  # skew: node 0
    w = torch.rand(T, K, generator=gen)
    dec = RoutingDecision(ids, w, torch.zeros(T, E), torch.zeros(T, E))
    x = torch.randn(T, D, generator=gen)
    for dedup in (True, False):
        tag = f"world={world} G={G} dedup={dedup}"
        disp = HierEPDispatcher(E, None, mode="buffered", dedup=dedup, ragged_buffer_factor=0.3, max_tokens=T,
                                top_k=K, node_group=hier[0], rail_group=hier[1], node_size=G)
        Cn = disp.rail_rows
        assert Cn == rail_rows(T, K, E, Nn, 0.3) == math.ceil(0.3 * T * node_hit_fraction(E, K, Nn)) < T, Cn
        # node links: 0.3 x the balanced T*k/G pairs, capped at the rows the rail delivers x min(K, L)
        C = min(Nn * Cn * min(K, L), math.ceil(0.3 * T * K / G))
        assert disp.inner.max_tokens == Nn * Cn and disp.inner.links(Nn * Cn, K).pair_slots == C == disp.capacity(T, K)
        xg = x.clone().requires_grad_(True)
        with forbid_host_sync(f"{tag}: host read in buffered two-level dispatch"):
            batch, meta = disp.dispatch(xg, dec)
            y = disp.combine(batch.x_RD * batch.weights_R[:, None], meta)
            y.sum().backward()
        # the rail's count, recounted: the pairs on node n of the tokens past its first Cn
        node_TK = ids // LG
        hit_TN = torch.stack([(node_TK == n).any(1) for n in range(Nn)], 1)
        late_TN = hit_TN & (torch.cumsum(hit_TN.long(), 0) > Cn)
        rail = sum(int((node_TK[late_TN[:, n]] == n).sum()) for n in range(Nn))
        assert int(meta.rail_dropped) == rail and int(meta.pairs_dropped) == rail + int(meta.inner.pairs_dropped), tag
        # the node's, recounted from the rows the experts got: every pair is computed or dropped once
        rows = int(batch.offsets_E[-1])  # align 1: one row per computed pair
        rail_g, node_g, rows_g = _group_sum(meta.rail_dropped, meta.inner.pairs_dropped, torch.tensor(rows))
        assert rail_g > 0 and node_g > 0 and rows_g + rail_g + node_g == world * T * K, (tag, rail_g, node_g, rows_g)
        assert torch.isfinite(xg.grad).all(), tag
        # retry: no level overflows, and the same numbers as the exact two-level dispatcher
        outs = []
        for variant in (disp.worst_case(), disp.exact()):
            assert type(variant) is HierEPDispatcher
            b, m = variant.dispatch(x, dec)
            assert int(m.pairs_dropped) == 0, (tag, variant.mode)
            outs.append(variant.combine(b.x_RD * b.weights_R[:, None], m))
        assert disp.worst_case().rail_rows == T and disp.exact().mode == "exact"
        assert torch.equal(outs[0], outs[1]), tag
        assert_close(outs[0], x * w.sum(1, keepdim=True), EP_REDUCED, msg=tag)
        # spill: the node level spills (one read of the node group's total), the rail cannot overflow
        spill = HierEPDispatcher(E, None, mode="buffered", dedup=dedup, ragged_buffer_factor=0.3, max_tokens=T,
                                 top_k=K, on_overflow="spill", node_group=hier[0], rail_group=hier[1], node_size=G)
        assert spill.rail_rows == T
        with forbid_host_sync(f"{tag}: spill", (EP_SPILL_TOTAL, EP_EXACT_SPLIT_SIZES)):
            b, m = spill.dispatch(x, dec)
        y = spill.combine(b.x_RD * b.weights_R[:, None], m)
        assert int(m.pairs_dropped) == 0 and _group_sum(m.pairs_spilled)[0] > 0, tag
        assert_close(y, outs[1], EP_REDUCED, msg=f"{tag} spill")
        # bytes to other nodes: the (Nn-1) blocks of Cn rows and routing rows, whatever they hold;
        # the flat buffered all-to-all sends every rank on another node its whole block
        row = D * 4 + K * 8
        assert int(meta.bytes_inter_node) == (Nn - 1) * Cn * row, tag
        assert int(meta.bytes_sent) == Nn * Cn * row + int(meta.inner.bytes_sent), tag
        flat = EPDispatcher(E, None, mode="buffered", dedup=dedup, ragged_buffer_factor=0.3, max_tokens=T, top_k=K)
        _, fm = flat.dispatch(x, dec)
        assert int(meta.bytes_inter_node) < int(fm.bytes_sent) * (world - G) // world, tag
    dist.barrier()


def _buffered_all(rank: int, world: int, G: int) -> None:
    _levels(rank, world, G, ep_hier_groups(world, G, "cpu"))
    _buffered_worker(rank, world, G)


@pytest.mark.parametrize("world,G", [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_two_level_buffered(world: int, G: int, tmp_path: Path) -> None:
    run_world(_buffered_all, world, tmp_path, G)


def _trainer_case(rank: int, world: int, root: Path) -> None:
    """The trainer's overflow guard, unchanged, on buffered two-level dispatch (2 ranks as 2 nodes of
    1): the expert bias sends every token to rank 0's experts, so at factor 0.5 the rail overflows
    (retry reruns the step at the worst case) and under spill the node level spills (applied as
    is); both follow exact two-level dispatch's losses at the EP floor."""
    base = ("model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0", "parallel.ep_size=2",
            "parallel.ep_hierarchy=node", "parallel.ep_node_size=1", "train.dtype=fp32", "train.steps=4")
    buffered = ("parallel.ep_mode=buffered", "parallel.ragged_buffer_factor=0.5")
    losses = {}
    for name, extra in (("exact", ()), ("retry", (*buffered, "parallel.on_overflow=retry")),
                        ("spill", (*buffered, "parallel.on_overflow=spill"))):
        trainer = Trainer(tiny(*base, *extra), root / name)
        for layer in trainer.model.moe_layers():
            layer.router.set_bias(torch.tensor([1.0, 1.0, 0.0, 0.0]))
        losses[name] = [float(trainer.train_step(step)[0].loss) for step in range(3)]
        if name != "exact":
            row = trainer.overflow.check(2)
            assert int(trainer.overflow.skipped) == 0, row
            if name == "retry":
                assert row["ep_steps_retried"] == 3 and row["ep_pairs_spilled"] == 0, row
            else:
                assert row["ep_steps_retried"] == 0 and row["ep_pairs_spilled"] > 0, row
    for name in ("retry", "spill"):
        for a, b in zip(losses["exact"], losses[name]):
            assert abs(a - b) <= PARALLEL_TRAIN_LOSS * abs(a), (name, losses)


def test_two_level_buffered_trainer(tmp_path: Path) -> None:
    run_world(_trainer_case, 2, tmp_path, tmp_path)


def test_two_level_refusals() -> None:
    with pytest.raises(ValueError, match="parallel.ep_hierarchy='node'.*parallel.ragged_buffer_factor='auto'"):
        ParallelConfig(ep_size=4, ep_hierarchy="node", ep_mode="buffered", ragged_buffer_factor="auto")
    ParallelConfig(ep_size=4, ep_hierarchy="node", ep_mode="buffered", on_overflow="spill")  # accepted
    with pytest.raises(ValueError, match="parallel.ep_hierarchy='node'.*parallel.ep_dispatch='ring'"):
        ParallelConfig(ep_size=4, ep_hierarchy="node", ep_dispatch="ring")
    with pytest.raises(ValueError, match="parallel.ep_hierarchy='node'.*parallel.pp_size=2"):
        ParallelConfig(ep_size=2, ep_hierarchy="node", pp_size=2)
    with pytest.raises(ValueError, match="parallel.ep_capturable=True.*parallel.ep_hierarchy='node'"):
        ParallelConfig(ep_size=4, ep_hierarchy="node", ep_mode="buffered", ep_capturable=True)
    with pytest.raises(ValueError, match="parallel.ep_node_size=3.*ep_size=4"):
        ParallelConfig(ep_size=4, ep_hierarchy="node", ep_node_size=3)
    with pytest.raises(ValueError, match="parallel.ep_hierarchy='tree'"):
        ParallelConfig(ep_hierarchy="tree")
