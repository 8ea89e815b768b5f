"""assert_close itself: the REFERENCE bound holds each element to its own size, so a small element that
is entirely wrong fails beside large ones, while rounding-level differences pass."""

from __future__ import annotations

import pytest
import torch

from tolerances import REFERENCE, Tol, assert_close

DTYPES = [torch.float32, torch.bfloat16]


def data(dtype: torch.dtype) -> torch.Tensor:
    # O(1)..O(10) entries, as the suite's gradients are, and one small one at [1, 2]
    x = 4 * torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    x[1, 2] = 0.01
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_small_element_entirely_wrong_fails(dtype: torch.dtype) -> None:
    expected = data(dtype)
    for wrong in (0.0, -0.01, 0.02):  # dropped, sign flipped, doubled
        actual = expected.clone()
        actual[1, 2] = wrong
        with pytest.raises(AssertionError, match=r"1 of 48 elements.*\(1, 2\)"):
            assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_level_differences_pass(dtype: torch.dtype) -> None:
    # The bound is not zero: every element moved by one rounding of its own dtype (the small one too)
    expected = data(dtype)
    one_ulp = torch.nextafter(expected.float(), torch.full_like(expected.float(), float("inf")))
    if dtype == torch.bfloat16:
        one_ulp = expected.float() * (1 + 2.0 ** -8)
    assert_close(one_ulp.to(dtype), expected)


def test_terms_bound_a_sum_with_cancellation() -> None:
    # e = 10 - 9.99 = 0.01: computed in another order its rounding is set by the terms (~10), not by
    # 0.01. An error of ~10 ulps of 10 (1e-5) passes when the terms are given, and fails without
    # them, where the element is held to its own size (bound 1e-5 * 0.01 + 5e-6).
    expected = torch.tensor([0.01, 3.0])
    actual = expected + torch.tensor([1e-5, 0.0])
    terms = torch.tensor([19.99, 3.0])
    assert_close(actual, expected, terms=terms)
    with pytest.raises(AssertionError, match="outside"):
        assert_close(actual, expected)


def test_nan_and_shape_mismatches_fail() -> None:
    e = torch.ones(3)
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([1.0, float("nan"), 1.0]), e)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.ones(4), e)
    with pytest.raises(AssertionError, match="dtype"):
        assert_close(torch.ones(3, dtype=torch.float64), e, Tol(1e-5, 0.0))
    assert_close(torch.full((2,), float("inf")), torch.full((2,), float("inf")), REFERENCE[torch.float32])
