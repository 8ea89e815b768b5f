"""Two-level dispatch (parallel.ep_hierarchy = "node", distributed/ep_hier.py) on gloo: 4 ranks as 2
nodes x 2 (and 2 ranks as 2 nodes x 1 and 1 node x 2). Against the single-process layer, every case
of test_ep.py at the EP floor (tolerances.EP_REDUCED), with de-dup on and off inside the node and
with the mxfp8 payload; and the rail trip's bytes to other nodes equal to the distinct (token,
destination node) pairs, which the flat all-to-all's exceed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_world
from dropless.config import ParallelConfig
from dropless.distributed.ep_hier import HierEPDispatcher
from dropless.distributed.mesh import ep_hier_groups
from dropless.layers.router import RoutingDecision
from dropless.ops import payload
from test_ep import _case_list, _check_parity, _run_case
from tolerances import EP_LOWP, EP_REDUCED


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


def test_two_level_refusals() -> None:
    with pytest.raises(ValueError, match="parallel.ep_hierarchy='node'.*exact mode"):
        ParallelConfig(ep_size=4, ep_hierarchy="node", ep_mode="buffered")
    with pytest.raises(ValueError, match="parallel.ep_node_size=3.*ep_size=4"):
        ParallelConfig(ep_size=4, ep_hierarchy="node", ep_node_size=3)
    with pytest.raises(ValueError, match="parallel.ep_hierarchy='tree'"):
        ParallelConfig(ep_hierarchy="tree")
