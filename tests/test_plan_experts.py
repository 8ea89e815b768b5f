"""`dropless plan` on the expert paths whose group ends are read on the host: the low-precision
recipes (`model.moe.precision`, ops/quant_gemm.py) and the per-expert loop backend
(`model.moe.backend = "loop"`). Fake tensors hold no values, so the planner runs these ops with
group ends of its own (plan/fake_world.py); what they keep for the backward does not depend on the
ends. Checked against the real model's tensors, as tests/test_plan.py does for the default path:
states to the byte, activations within 2% (at world 1 the default path agrees to a few hundred
bytes; leaving out the unquantised operands the recipes keep, or the bf16 weight copy autocast
makes for them, costs far more)."""

from __future__ import annotations

import pytest

from dropless.plan.model import plan
from dropless.plan.validate import measure
from plan_cases import check_two_ranks, config, one_thread  # noqa: F401  (one_thread: an autouse fixture)

# d_model 256 and d_expert 128 split into whole blocks of every recipe (16, 32 and 128 wide)
SMALL = ["model.n_layers=3", "train.batch_size=2", "train.seq_len=64", "model.max_seq_len=64",
         "train.optimizer=adamw", "model.moe.num_experts=4", "model.moe.d_expert=128"]


def small(*extra: str, dtype: str = "fp32"):
    return config(SMALL, *extra, dtype=dtype)


def _check(cfg) -> None:
    measured = measure(cfg, steps=1, distributed=False)
    p = plan(cfg, 1)
    for comp in ("params", "grads", "optimizer"):
        assert getattr(p, comp) == measured[comp], comp
    assert abs(p.activations / measured["activations"] - 1) < 0.02, (p.activations, measured["activations"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("precision", ["mxfp8", "fp8_blockwise", "nvfp4", "mxfp4"])
def test_low_precision_experts_match_the_real_model(precision: str, dtype: str) -> None:
    """Each recipe trains fp32 master weights (4 B per element: nothing is stored packed during
    training) and keeps its GEMMs' unquantised operands for the backward: under bf16 autocast the
    rows and a bf16 copy of every expert weight, per GEMM. The host read of the group ends made
    the plan raise on fake tensors."""
    _check(small(f"model.moe.precision={precision}", dtype=dtype))


@pytest.mark.parametrize("extra", [[], ["model.moe.capacity_factor=1.25"], ['model.recompute=["moe_act"]']],
                         ids=["dropless", "capacity", "moe_act"])
def test_loop_backend_matches_the_real_model(extra: list[str]) -> None:
    """The loop backend as configured, capacity layout included (the planner once swapped the
    backend for grouped_mm only in the dropless layout, so a capacity run with `loop` raised)."""
    _check(small("model.moe.backend=loop", *extra))


@pytest.mark.slow
def test_low_precision_under_expert_parallelism_matches_two_ranks() -> None:
    """World 2, EP 2 buffered, on two gloo processes: the experts' share is re-measured for the
    local experts on the received rows (plan/activations.expert_bytes) through the same recipe,
    whose token block pads every group; states exact, buffers to 0.1%, activations within 2%."""
    check_two_ranks(small("model.moe.precision=mxfp8", "parallel.ep_size=2", "parallel.ep_mode=buffered", dtype="bf16"))
