"""A capturable EP layer (parallel.ep_capturable): buffered expert parallelism on torch's functional
collectives traces into one graph. On 2 gloo ranks, an MoE layer's forward and backward are compiled
with `fullgraph=True` and run 20 times with changing routing (a new batch each call; links sized at the balanced
load, so some calls overflow and others do not): no graph break, no recompile after the first call, outputs and gradients equal
to the same layer run eagerly, and the overflow counted on the device. The plain buffered layer
(dist.all_to_all_single inside an autograd function) is refused by fullgraph: the test can fail."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from compile_counts import reading_backend
from dist_harness import run_world
from dropless.config import MoEConfig, ParallelConfig
from dropless.distributed.parallelize_ep import shard_moe_layer
from dropless.layers.moe import MoELayer
from tolerances import EP_REDUCED, assert_close

T, D, E, K = 12, 16, 8, 2


def _layer(world: int, capturable: bool, factor: float) -> MoELayer:
    torch.manual_seed(0)
    base = MoELayer(D, MoEConfig(num_experts=E, top_k=K, d_expert=8, n_shared_experts=1, d_shared=4))
    return shard_moe_layer(copy.deepcopy(base), None, ParallelConfig(
        ep_size=world, ep_mode="buffered", max_tokens_per_rank=T, ragged_buffer_factor=factor,
        ep_capturable=capturable))


def _step(layer: MoELayer):
    def step(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = layer(x)
        return (out.y * g).sum(), out.stats.pairs_dropped
    return step


def _worker(rank: int, world: int) -> None:
    torch._dynamo.reset()
    counters.clear()
    eager, traced = _layer(world, True, 1.0), _layer(world, True, 1.0)
    reads: list[str] = []
    compiled = torch.compile(_step(traced), fullgraph=True, backend=reading_backend(reads))
    graphs, drops = [], []
    for i in range(20):
        gen = torch.Generator().manual_seed(100 * i + rank)
        x, g = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
        outs = []
        for layer, fn in ((eager, _step(eager)), (traced, compiled)):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            loss, dropped = fn(xi, g)
            loss.backward()
            outs.append((loss.detach(), dropped, xi.grad, [p.grad for p in layer.parameters()]))
        (le, de, ge, pe), (lc, dc, gc, pc) = outs
        assert_close(lc, le, EP_REDUCED, msg=f"call {i} loss")
        assert torch.equal(dc, de), (i, int(dc), int(de))
        drops.append(int(de))
        assert_close(gc, ge, EP_REDUCED, msg=f"call {i} x.grad")
        for a, b in zip(pc, pe):
            assert_close(a, b, EP_REDUCED, msg=f"call {i} param grad")
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not reads, reads  # no value read on the host inside the graph (fullgraph misses `item`)
    assert min(drops) == 0 < max(drops), drops  # overflowing calls and others, one graph for both
    assert graphs[0] >= 1 and graphs[-1] == graphs[0], graphs  # compiled once, never again
    # evaluation's exact-mode variant is a plain (uncaptured) dispatcher, not a refused one
    ex = traced.dispatcher.exact()
    assert (ex.mode, ex.capturable, traced.dispatcher.worst_case().capturable) == ("exact", False, True)
    torch._dynamo.reset()
    plain = _layer(world, False, 1.0)
    with pytest.raises(Exception, match="Unsupported|graph break|call_method"):
        torch.compile(_step(plain), fullgraph=True, backend="aot_eager")(torch.randn(T, D), torch.randn(T, D))


def test_capturable_ep_layer_traces_once(tmp_path: Path) -> None:
    run_world(_worker, 2, tmp_path)


def test_capturable_refusals() -> None:
    with pytest.raises(ValueError, match="parallel.ep_capturable.*ep_mode='exact'"):
        ParallelConfig(ep_size=2, ep_capturable=True)
    # spill is capturable: its second trip is decided on the device (test_ep_capture_spill.py)
    assert ParallelConfig(ep_size=2, ep_mode="buffered", on_overflow="spill", ep_capturable=True).ep_capturable
    with pytest.raises(ValueError, match="parallel.ep_capturable.*ep_dispatch='ring'"):
        ParallelConfig(ep_size=2, ep_mode="buffered", ep_dispatch="ring", ep_capturable=True)
    with pytest.raises(ValueError, match="parallel.ep_capturable.*dispatch_dtype='mxfp8'"):
        ParallelConfig(ep_size=2, ep_mode="buffered", dispatch_dtype="mxfp8", ep_capturable=True)
