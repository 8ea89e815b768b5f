"""The host-sync guard (tests/host_sync.py) and the dropless paths that promise to run under it.

The guard first: every syncing pattern it must refuse (host reads and data-dependent output shapes),
the static-shape forms of the same ops it must let through, the reason the method patches alone are
not enough (they never see a boolean-mask index), and allowances covering one function only. Then
every layer path the design promises no host sync for (docs/design.md, "Dropless guarantees"), forward
and backward, and the model's training call; the trainer's step runs under the guard in
tests/train/test_nonfinite.py and test_bias_rules.py, buffered EP in tests/distributed/.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from dropless.config import ModelConfig, MoEConfig, RouterConfig
from dropless.layers import decode_experts
from dropless.layers.moe import MoELayer
from dropless.model import MoEModel
from host_sync import Allowance, HostSync, _patched_reads, forbid_host_sync

x = torch.arange(12.0).reshape(4, 3)
mask = torch.tensor([True, False, True, True])
idx = torch.tensor([2, 0, 3])
counts = torch.tensor([1, 0, 2, 1])


def _set_mask() -> None:
    y = x.clone()
    y[mask] = 0.0


# Each on a GPU waits for the device: a value read into Python, or an output sized by the values.
SYNCING: dict[str, Callable[[], object]] = {
    "mask index": lambda: x[mask],
    "mask index in the mutation's form": lambda: x[x.abs().sum(-1) >= 0],
    "mask assignment": _set_mask,
    "index_put with a mask": lambda: x.clone().index_put_((mask,), torch.tensor(0.0)),
    "masked_select": lambda: x.masked_select(mask[:, None]),
    "nonzero": lambda: mask.nonzero(),
    "where(cond)": lambda: torch.where(mask),
    "argwhere": lambda: torch.argwhere(mask),
    "unique": lambda: counts.unique(),
    "bincount": lambda: torch.bincount(counts),
    "repeat_interleave by a tensor": lambda: torch.repeat_interleave(x, counts, dim=0),
    "one_hot without num_classes": lambda: torch.nn.functional.one_hot(counts),
    "item": lambda: counts.sum().item(),
    "tolist": lambda: counts.tolist(),
    "bool": lambda: bool(counts.any()),
    "int": lambda: int(counts[0]),
    "float": lambda: float(x[0, 0]),
    "equal": lambda: torch.equal(x, x),
    "allclose": lambda: torch.allclose(x, x),
}

# The same ops with shapes fixed by the arguments' shapes: nothing to wait for.
STATIC: dict[str, Callable[[], object]] = {
    "integer index": lambda: x[idx],
    "integer index assignment": lambda: x.clone().index_put_((idx,), torch.tensor(0.0)),
    "index_select": lambda: x.index_select(0, idx),
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(x, counts, dim=0, output_size=4),
    "nonzero_static": lambda: torch.nonzero_static(mask, size=4),
    "where(cond, a, b)": lambda: torch.where(mask[:, None], x, 0.0),
    "masked_fill": lambda: x.masked_fill(mask[:, None], 0.0),
    "sort, topk, cumsum": lambda: (x.sort(0), x.topk(2), counts.cumsum(0)),
    "searchsorted": lambda: torch.searchsorted(counts.sort().values, idx),
}


@pytest.mark.parametrize("case", sorted(SYNCING))
def test_guard_refuses_every_syncing_pattern(case: str) -> None:
    with pytest.raises(HostSync):
        with forbid_host_sync(case):
            SYNCING[case]()


@pytest.mark.parametrize("case", sorted(STATIC))
def test_guard_lets_static_shapes_through(case: str) -> None:
    with forbid_host_sync(case):
        STATIC[case]()


def test_method_patches_alone_miss_a_mask_index() -> None:
    """Why the dispatch mode exists: `x[mask]` sizes its output with a nonzero() inside the index
    kernel, never through a Python-level read, so patching the Tensor methods sees nothing."""
    with _patched_reads("methods only", ()):
        assert x[mask].shape == (3, 3)
        with pytest.raises(HostSync):
            counts.tolist()


def _in_dropless_file(path: str, source: str, name: str) -> Callable:
    """A function `name` compiled as if it were written in dropless's `path` (the allowance reads
    the file and function name off the Python stack)."""
    scope: dict = {}
    exec(compile(source, f"/repo/src/dropless/{path}", "exec"), scope)
    return scope[name]


def test_an_allowance_covers_its_function_and_nothing_it_calls() -> None:
    allow = (Allowance("dropless/distributed/ep.py", "reads", "a test's reason"),)
    reads = _in_dropless_file("distributed/ep.py", "def reads(t):\n    return t.tolist(), t[t > 0]\n", "reads")
    other = _in_dropless_file("distributed/ep.py", "def other(t):\n    return t.tolist()\n", "other")
    helper = _in_dropless_file("ops/helper.py", "def helper(t):\n    return t.tolist()\n", "helper")
    calls = _in_dropless_file("distributed/ep.py", "def reads(t, f):\n    return f(t)\n", "reads")
    with forbid_host_sync("allowed", allow):
        assert reads(counts)[0] == [1, 0, 2, 1]
        for fn in (other, lambda t: calls(t, helper), lambda t: t.tolist()):
            with pytest.raises(HostSync):
                fn(counts)


# ---------------------------------------------------------------------------------------------------
# The dropless paths. Why each: the local dispatcher (token choice, with alignment padding and shared
# experts), every routing strategy that keeps the no-sync promise (expert choice, expert threshold,
# hash, forced balance), identity experts (a masked plan), LatentMoE (projections around dispatch),
# the capacity baseline, detailed statistics, and the decode path (a row-sum instead of the plan).
LAYERS = {
    "local_token_choice": dict(),
    "local_align4_shared": dict(align=4, n_shared_experts=1),
    "group_limited_bias": dict(router=RouterConfig(score_func="sigmoid", n_groups=4, topk_groups=2,
                                                   use_expert_bias=True)),
    "expert_choice": dict(router=RouterConfig(strategy="expert_choice")),
    "expert_threshold": dict(router=RouterConfig(strategy="expert_threshold", max_experts_per_token=3)),
    "hash": dict(router=RouterConfig(strategy="hash")),
    "forced_balance": dict(router=RouterConfig(strategy="forced_balance")),
    "identity_experts": dict(n_identity_experts=2),
    "latent": dict(latent_dim=8, latent_norm=True, n_identity_experts=1),
    "capacity_baseline": dict(capacity_factor=1.25),
}


@pytest.mark.parametrize("detailed", [False, True], ids=["stats", "detailed_stats"])
@pytest.mark.parametrize("case", sorted(LAYERS))
def test_layer_forward_backward_without_host_sync(case: str, detailed: bool) -> None:
    torch.manual_seed(0)
    layer = MoELayer(16, MoEConfig(num_experts=8, top_k=2, d_expert=12, **LAYERS[case]))
    layer.detailed_stats = detailed
    inp = torch.randn(2, 10, 16, requires_grad=True)
    token_ids = torch.randint(0, 256, (2, 10))
    with forbid_host_sync(f"host sync in the {case} layer"):
        out = layer(inp, token_ids=token_ids)
        (out.y.square().mean() + out.aux_loss + out.z_loss).backward()
    assert inp.grad is not None


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_decode_path_without_host_sync(grad: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = []
    real = decode_experts.row_sum_experts
    monkeypatch.setattr(decode_experts, "row_sum_experts", lambda *a: taken.append(1) or real(*a))
    torch.manual_seed(0)
    layer = MoELayer(16, MoEConfig(num_experts=8, top_k=2, d_expert=12, n_shared_experts=1))
    layer.decode_max_tokens = 8
    inp = torch.randn(1, 6, 16, requires_grad=grad)
    with torch.set_grad_enabled(grad), forbid_host_sync("host sync in the decode path"):
        out = layer(inp)
        if grad:
            out.y.sum().backward()
    assert taken == [1]


def test_model_training_call_without_host_sync() -> None:
    """The whole training forward and backward: attention, dense and MoE blocks, the balancing
    losses, multi-token prediction with a padded (ignored) target."""
    torch.manual_seed(0)
    model = MoEModel(ModelConfig(d_model=32, n_layers=3, n_heads=2, max_seq_len=16, d_ff_dense=32,
                                 mtp_depth=2, moe=MoEConfig(num_experts=4, top_k=2, d_expert=16)))
    tokens = torch.randint(0, 256, (2, 13))
    targets = tokens[:, 1:].clone()
    targets[1, -3:] = -100
    with forbid_host_sync("host sync in the model's training call"):
        out = model(tokens[:, :-1], targets)
        out.loss.backward()
    assert model.embed.weight.grad is not None
