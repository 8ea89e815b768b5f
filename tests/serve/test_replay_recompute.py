"""Recompute under replay never re-routes.

Activation recompute (here torch.utils.checkpoint around every block, what users wrap a model in)
runs each block's forward again during backward. Under routing replay that second forward must take
the replayed ids, not route again: otherwise a router that changed in between, or a non-deterministic
strategy, would compute the gradient of a different network than the one whose loss was taken.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dropless.model import MoEModel
from dropless.ops import routing
from tiny_run import tiny

CFG = ["model.n_layers=3", "model.moe.router.use_expert_bias=true"]  # blocks 1 and 2 are MoE


def model_and_batch() -> tuple[MoEModel, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = MoEModel(tiny(*CFG).model)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (2, 24), generator=g)
    return model, x, torch.roll(x, -1, 1)


def checkpoint_blocks(model: MoEModel) -> None:
    for block in model.blocks:
        inner = block.forward
        block.forward = lambda *args, _f=inner: checkpoint(_f, *args, use_reentrant=False)


def recorded_ids(model: MoEModel, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(x)
    return [m.ids_TK.view(*x.shape, -1) for m in out.moe]


def grads(model: MoEModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class TopkCounter:
    """Counts calls into token-choice routing (routing.topk_route), split into forward and backward."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls, self.phase = {"forward": 0, "backward": 0}, "forward"
        real = routing.topk_route

        def counting(*args, **kwargs):
            self.calls[self.phase] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(routing, "topk_route", counting)


def test_checkpointed_backward_does_not_route_under_replay(monkeypatch) -> None:
    model, x, y = model_and_batch()
    ids = recorded_ids(model, x)
    checkpoint_blocks(model)
    counter = TopkCounter(monkeypatch)
    # without replay the recompute routes again, once per MoE layer: the counter sees recompute
    loss = model(x, y).loss
    counter.phase = "backward"
    loss.backward()
    assert counter.calls == {"forward": 2, "backward": 2}
    # under replay: no routing at all, in the forward or in the recompute
    counter.calls = {"forward": 0, "backward": 0}
    counter.phase = "forward"
    loss = model(x, y, replay_ids=ids).loss
    counter.phase = "backward"
    loss.backward()
    assert counter.calls == {"forward": 0, "backward": 0}


def test_router_change_between_forward_and_recompute(monkeypatch) -> None:
    """The expert bias moves between the forward and the backward (it is a selection-only buffer, so
    the combine weights do not depend on it): a recompute that routes again picks other experts; a
    replayed recompute gives exactly the gradients of the same replay run without checkpointing."""
    model, x, y = model_and_batch()
    ids = recorded_ids(model, x)
    shift = torch.tensor([50.0, 50.0, 0.0, 0.0])  # every token to experts 0 and 1 once applied

    # the references, without checkpointing: the router choosing, and replay
    model(x, y).loss.backward()
    want_free = grads(model)
    model.zero_grad(set_to_none=True)
    model(x, y, replay_ids=ids).loss.backward()
    want = grads(model)
    model.zero_grad(set_to_none=True)

    checkpoint_blocks(model)
    loss = model(x, y, replay_ids=ids).loss
    for layer in model.moe_layers():
        layer.router.set_bias(layer.router.expert_bias + shift)
    loss.backward()
    got = grads(model)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    model.zero_grad(set_to_none=True)
    for layer in model.moe_layers():
        layer.router.set_bias(layer.router.expert_bias - shift)

    # without replay the recompute re-routes under the new bias: every token now goes to experts 0
    # and 1, and the backward silently differentiates that network (the saved tensors keep their
    # shapes, so checkpoint's metadata check does not notice): the gradients are not the forward's
    loss = model(x, y).loss
    for layer in model.moe_layers():
        layer.router.set_bias(layer.router.expert_bias + shift)
    loss.backward()
    got = grads(model)
    expert = "blocks.1.ffn.experts.w_down_EFD"
    assert torch.equal(got[expert][2:], torch.zeros_like(got[expert][2:]))  # experts 2, 3 got no row
    assert not torch.allclose(got[expert], want_free[expert])
