"""Ring dispatch (parallel.ep_dispatch = "ring") against the single-process layer: every case of
test_ep.py (router-chosen routing, alignment padding with shared experts, all tokens on one rank's
experts, an empty sender, uneven token counts, k = E, expert choice and threshold, mxfp8 experts), in
exact and buffered mode, at the EP floor (tolerances.EP_REDUCED: the reduce-scatter sums the ranks'
shares in the backend's order); the overflow of too-small buffered bounds counted, never silent; the
byte rule that picks "auto"; and the refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_world
from dropless.config import ParallelConfig
from dropless.distributed.ep import EPDispatcher
from dropless.distributed.ep_ring import expected_ranks_hit, ring_sends_fewer
from test_ep import _case_list, _check_parity, _run_case
from tolerances import EP_LOWP, EP_REDUCED


def _worker(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    for case in _case_list(world):
        for mode in ("exact", "buffered"):
            factor = -1 if case.get("force") else "tight"
            tag = f"world={world} ring {case['name']} {mode}"
            res = _run_case(rank, world, case, mode, True, factor, ep_dispatch="ring")
            _check_parity(tag, res, EP_LOWP if case.get("precision") else EP_REDUCED)
            st = res["_stats"]
            assert int(st.pairs_dropped) == 0, tag
            # pairs are computed where their expert lives: the group's total is the reference's
            got = torch.stack([st.pairs_computed, torch.tensor(res["_pairs_ref"])])
            dist.all_reduce(got)
            assert int(got[0]) == int(got[1]), tag
            offsets, want = res["_offsets"]
            assert torch.equal(offsets.long(), want), f"{tag} offsets {offsets.tolist()} != {want.tolist()}"
        if case.get("force") == "rank0":  # a bound below the load: counted where the experts are
            res = _run_case(rank, world, case, "buffered", True, 0.5, ep_dispatch="ring")
            st = res["_stats"]
            tot = torch.stack([st.pairs_dropped, st.pairs_computed])
            dist.all_reduce(tot)
            assert int(tot[0]) > 0 and int(tot.sum()) == sum(case["T"]) * case["K"], tot.tolist()
            for name, pair in res.items():
                if not name.startswith("_"):
                    assert torch.isfinite(pair[0]).all(), name


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_matches_single_process(world: int, tmp_path: Path) -> None:
    run_world(_worker, world, tmp_path)


def test_auto_rule() -> None:
    """The ring sends each token to every rank and gets P shares back; the all-to-all sends it where
    its experts are. Without de-dup the ring wins once k > P; against de-dup at uniform routing it
    never sends fewer (a token misses some rank with probability > 0); against buffered de-dup links
    as large as the batch it ties (and "auto" keeps the all-to-all)."""
    base = dict(ep_size=4, num_experts=64, width=1024, dtype=torch.bfloat16, payload="native", tokens=1024)
    assert expected_ranks_hit(64, 16, 8) == pytest.approx(4 * (1 - math.comb(48, 8) / math.comb(64, 8)))  # 3.66
    assert not ring_sends_fewer(**base, top_k=8, mode="exact", dedup=True, link_pairs=None)
    assert ring_sends_fewer(**base, top_k=8, mode="exact", dedup=False, link_pairs=None)
    assert not ring_sends_fewer(**base, top_k=2, mode="exact", dedup=False, link_pairs=None)
    # buffered, factor 2 at k = 8: 4096 pair slots per link, so the de-dup rows fill T per link
    assert not ring_sends_fewer(**base, top_k=8, mode="buffered", dedup=True, link_pairs=4096)
    assert ring_sends_fewer(**base, top_k=8, mode="buffered", dedup=False, link_pairs=4096)


def test_ring_refusals() -> None:
    with pytest.raises(ValueError, match="parallel.ep_dispatch='ring'.*spill"):
        ParallelConfig(ep_dispatch="ring", ep_mode="buffered", on_overflow="spill")
    with pytest.raises(ValueError, match="parallel.ep_dispatch='auto'.*replicate_hot_experts"):
        ParallelConfig(ep_dispatch="auto", replicate_hot_experts=2)
    with pytest.raises(ValueError, match="parallel.ep_dispatch='tree'"):
        ParallelConfig(ep_dispatch="tree")
    ParallelConfig(ep_dispatch="ring", on_overflow="spill")  # exact mode: spill never happens
