"""What the planner tests share: configs on the `tiny` preset with a test file's own small sizes, and
one thread while they measure (the planner's figures are bytes; one thread keeps a measured run's
allocator pattern the same on every machine, and the suite's other processes off its cores)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dropless.config import load_config
from dropless.runs.presets import preset_path


def config(sizes: list[str], *extra: str, dtype: str = "fp32"):
    return load_config(preset_path("tiny"), [*sizes, f"train.dtype={dtype}", *extra])


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def check_two_ranks(cfg) -> None:
    """The plan of `cfg` at world 2 against a measured run on two gloo processes: the states exact,
    the all-to-all buffers to 0.1%, the activations within 2%."""
    from dropless.plan.model import plan
    from dropless.plan.validate import measured_max

    measured = measured_max(cfg, 2, steps=1)
    p = plan(cfg, 2)
    for comp in ("params", "grads", "optimizer"):
        assert getattr(p, comp) == measured[comp], comp
    assert abs(p.ep_buffers / measured["ep_buffers"] - 1) < 0.001, (p.ep_buffers, measured["ep_buffers"])
    assert abs(p.activations / measured["activations"] - 1) < 0.02, (p.activations, measured["activations"])
