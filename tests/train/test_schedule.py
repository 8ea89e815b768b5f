"""lr_at: warm-up ramps, cosine ends at min, WSD holds then decays, constant holds, bad input raises."""

from __future__ import annotations

import math

import pytest

from dropless.train.schedule import lr_at

BASE = 3e-3
TOTAL = 1000
WARMUP = 100


def lrs(kind: str, **kw: float) -> list[float]:
    return [
        lr_at(s, base_lr=BASE, warmup_steps=WARMUP, total_steps=TOTAL, kind=kind, **kw)
        for s in range(TOTAL)
    ]


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
def test_warmup_ramps_linearly(kind: str) -> None:
    v = lrs(kind)
    assert v[0] == pytest.approx(BASE / WARMUP)
    assert all(b > a for a, b in zip(v[:WARMUP], v[1:WARMUP]))
    assert v[WARMUP - 1] == pytest.approx(BASE)


def test_cosine_decays_monotonically_to_min() -> None:
    v = lrs("cosine", min_lr_ratio=0.1)
    tail = v[WARMUP:]
    assert all(b <= a for a, b in zip(tail, tail[1:]))
    assert v[-1] == pytest.approx(0.1 * BASE)
    mid = WARMUP + (TOTAL - 1 - WARMUP) // 2
    assert v[mid] == pytest.approx(0.55 * BASE, rel=1e-2)  # half-way down the half cosine
    # past the end it holds min
    assert lr_at(5 * TOTAL, base_lr=BASE, warmup_steps=WARMUP, total_steps=TOTAL) == pytest.approx(0.1 * BASE)


def test_wsd_holds_then_decays() -> None:
    v = lrs("wsd", min_lr_ratio=0.0, decay_fraction=0.2)
    decay_steps = 200
    stable = v[WARMUP : TOTAL - decay_steps]
    assert all(x == BASE for x in stable)
    decay = v[TOTAL - decay_steps :]
    assert len(decay) == decay_steps
    assert all(b < a for a, b in zip(decay, decay[1:]))
    assert decay[0] < BASE
    assert v[-1] == 0.0


def test_wsd_zero_decay_is_constant() -> None:
    assert lrs("wsd", decay_fraction=0.0)[WARMUP:] == [BASE] * (TOTAL - WARMUP)


def test_constant_and_no_warmup() -> None:
    assert lrs("constant")[WARMUP:] == [BASE] * (TOTAL - WARMUP)
    assert lr_at(0, base_lr=BASE, warmup_steps=0, total_steps=10, kind="cosine") == BASE


def test_single_step_run() -> None:
    # total_steps=1: the only step is the last, so a decaying schedule sits at min there.
    assert lr_at(0, base_lr=1.0, warmup_steps=0, total_steps=1, kind="cosine") == pytest.approx(0.1)
    assert math.isfinite(lr_at(0, base_lr=1.0, warmup_steps=1, total_steps=1, kind="wsd"))


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"kind": "linear"}, "kind='linear'"),
        ({"step": -1}, "step"),
        ({"warmup_steps": 2000}, "warmup_steps"),
        ({"total_steps": 0}, "total_steps"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"decay_fraction": -0.1}, "decay_fraction"),
        ({"base_lr": -1.0}, "base_lr"),
    ],
)
def test_bad_arguments_raise(kw: dict, field: str) -> None:
    args = dict(step=0, base_lr=BASE, warmup_steps=WARMUP, total_steps=TOTAL, kind="cosine")
    args.update(kw)
    step = args.pop("step")
    with pytest.raises(ValueError, match=field):
        lr_at(step, **args)
