"""OverflowGuard.count over a micro-batch's layers: a layer whose path cannot drop reports no dropped
pairs (None) and adds nothing; the others' drops add up and the busiest link is the maximum."""

from __future__ import annotations

import torch

from dropless.layers.moe import MoEStats
from dropless.train.overflow import OverflowGuard


def test_count_skips_paths_that_cannot_drop() -> None:
    counts = torch.tensor([3, 1], dtype=torch.int64)
    local = MoEStats(counts, None)  # the local dropless plan: nothing can drop
    ep = MoEStats(counts, torch.tensor(2), link_demand=torch.tensor(5))
    ep2 = MoEStats(counts, torch.tensor(1), link_demand=torch.tensor(7))
    dropped, demand = OverflowGuard.count([local, ep, local, ep2])
    assert (int(dropped), int(demand)) == (3, 7)
    assert int(OverflowGuard.count([local])[0]) == 0
    # pairs_computed is derived: the counts' sum less the drops
    assert (int(local.pairs_computed), int(ep.pairs_computed)) == (4, 2)
