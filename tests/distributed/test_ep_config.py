"""ParallelConfig validation, the EP combinations refused at validation, and the buffered-mode sizing
rules (pure functions, no processes)."""

from __future__ import annotations

import pytest
import torch

from dropless.config import ParallelConfig, apply_overrides, load_config
from dropless.distributed.ep import link_capacity, must_invalidate


@pytest.mark.parametrize("field,value", [
    ("ep_size", 0), ("ep_mode", "fast"), ("ragged_buffer_factor", 0.0), ("ragged_buffer_factor", -2.0),
    ("overflow_check_every", 0), ("dedup", "yes"), ("max_tokens_per_rank", -1), ("max_tokens_per_rank", 2.5),
    ("ragged_buffer_factor", "big"), ("ragged_buffer_factor", "0"), ("on_overflow", "drop"),
])
def test_parallel_config_rejects(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"parallel.{field}="):
        ParallelConfig(**{field: value})


def test_on_overflow_and_the_older_switch() -> None:
    # configs and checkpoints that predate on_overflow carry retry_on_overflow: it still decides
    assert ParallelConfig().overflow_policy == "retry"
    assert ParallelConfig(retry_on_overflow=False).overflow_policy == "skip"
    # on_overflow, when set, wins
    assert ParallelConfig(retry_on_overflow=False, on_overflow="spill").overflow_policy == "spill"
    cfg = apply_overrides(ParallelConfig(), ["on_overflow=skip", "ragged_buffer_factor=auto"])
    assert (cfg.overflow_policy, cfg.ragged_buffer_factor) == ("skip", "auto")
    # a number given as text (an override) is stored as a float
    assert apply_overrides(ParallelConfig(), ["ragged_buffer_factor=1.5"]).ragged_buffer_factor == 1.5


def test_parallel_config_defaults_and_overrides() -> None:
    cfg = ParallelConfig()
    assert (cfg.ep_size, cfg.ep_mode, cfg.dedup, cfg.ragged_buffer_factor) == (1, "exact", True, 2.0)
    cfg = apply_overrides(cfg, ["ep_size=4", "ep_mode=buffered", "ragged_buffer_factor=-1"])
    assert (cfg.ep_size, cfg.ep_mode, cfg.ragged_buffer_factor) == (4, "buffered", -1)
    with pytest.raises(ValueError, match="parallel.ep_size=3.*num_experts=64"):
        ParallelConfig(ep_size=3).check_experts(64)


@pytest.mark.parametrize("overrides,names", [
    # expert parallelism is dropless: shard_moe_layer would refuse the capacity baseline at build
    (["parallel.ep_size=2", "model.moe.capacity_factor=1.25"], ["parallel.ep_size=2", "capacity_factor=1.25"]),
    # a bound below the micro-batch: the first forward would raise (T > max_tokens)
    (["parallel.ep_mode=buffered", "parallel.max_tokens_per_rank=100", "train.batch_size=2", "train.seq_len=64"],
     ["parallel.max_tokens_per_rank=100", "train.batch_size * train.seq_len = 128"]),
    # the buffered overflow guard needs AdamW's state: the trainer would raise when it starts
    (["parallel.ep_mode=buffered", "train.optimizer=adamw_bf16"],
     ["parallel.ep_mode='buffered'", "train.optimizer='adamw_bf16'"]),
])
def test_ep_combinations_refused_at_validation(overrides: list[str], names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    for name in names:
        assert name in str(err.value)


def test_ep_combinations_allowed() -> None:
    # what this issue made work: masked strategies and low precision under EP; a bound at or above
    # the micro-batch; exact mode ignores the bound
    load_config(None, ["parallel.ep_size=2", "model.moe.router.strategy=expert_choice"])
    load_config(None, ["parallel.ep_size=2", "model.moe.precision=mxfp8"])
    load_config(None, ["parallel.ep_mode=buffered", "parallel.max_tokens_per_rank=128", "train.batch_size=2",
                       "train.seq_len=64"])
    load_config(None, ["parallel.max_tokens_per_rank=1", "train.optimizer=adamw_bf16"])


def test_token_bound_filled_from_the_micro_batch() -> None:
    assert ParallelConfig().with_token_bound(4096).max_tokens_per_rank == 4096
    assert ParallelConfig(max_tokens_per_rank=5000).with_token_bound(4096).max_tokens_per_rank == 5000


def test_link_capacity() -> None:
    # balanced: T*K/P pairs per link; factor 2 doubles it
    assert link_capacity(100, 8, 16, 4, 2.0) == 400
    # capped at the worst case T*min(K, L): a token has at most min(K, L) experts on one rank
    assert link_capacity(100, 8, 4, 16, 100.0) == 400
    assert link_capacity(100, 8, 16, 4, -1) == 800
    assert link_capacity(0, 8, 16, 4, 2.0) == 0
    # variable-count strategies: about k = 2 pairs per token on E = 16 slots, L = 4 local experts; the
    # worst case is every token on all 4 of a rank's experts
    assert link_capacity(100, 2, 4, 4, 2.0, slots=16) == 100
    assert link_capacity(100, 2, 4, 4, -1, slots=16) == 400


def test_must_invalidate_is_a_device_flag() -> None:
    assert not bool(must_invalidate(torch.tensor(0)))
    flag = must_invalidate(torch.tensor(3))
    assert flag.dtype == torch.bool and bool(flag)
