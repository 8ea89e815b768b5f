"""ParallelConfig validation and the buffered-mode sizing rules (pure functions, no processes)."""

from __future__ import annotations

import pytest
import torch

from dropless.config import ParallelConfig, apply_overrides
from dropless.distributed.ep import link_capacity, must_invalidate


@pytest.mark.parametrize("field,value", [
    ("ep_size", 0), ("ep_mode", "fast"), ("ragged_buffer_factor", 0.0), ("ragged_buffer_factor", -2.0),
    ("overflow_check_every", 0), ("dedup", "yes"),
])
def test_parallel_config_rejects(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"parallel.{field}="):
        ParallelConfig(**{field: value})


def test_parallel_config_defaults_and_overrides() -> None:
    cfg = ParallelConfig()
    assert (cfg.ep_size, cfg.ep_mode, cfg.dedup, cfg.ragged_buffer_factor) == (1, "exact", True, 2.0)
    cfg = apply_overrides(cfg, ["ep_size=4", "ep_mode=buffered", "ragged_buffer_factor=-1"])
    assert (cfg.ep_size, cfg.ep_mode, cfg.ragged_buffer_factor) == (4, "buffered", -1)
    with pytest.raises(ValueError, match="parallel.ep_size=3.*num_experts=64"):
        ParallelConfig(ep_size=3).check_experts(64)


def test_link_capacity() -> None:
    # balanced: T*K/P pairs per link; factor 2 doubles it
    assert link_capacity(100, 8, 16, 4, 2.0) == 400
    # capped at the worst case T*min(K, L): a token has at most min(K, L) experts on one rank
    assert link_capacity(100, 8, 4, 16, 100.0) == 400
    assert link_capacity(100, 8, 16, 4, -1) == 800
    assert link_capacity(0, 8, 16, 4, 2.0) == 0


def test_must_invalidate_is_a_device_flag() -> None:
    assert not bool(must_invalidate(torch.tensor(0)))
    flag = must_invalidate(torch.tensor(3))
    assert flag.dtype == torch.bool and bool(flag)
