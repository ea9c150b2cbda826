"""Tests for per-team limit validation and guaranteed-share overflow."""

from __future__ import annotations

import math

import pytest

from accounts.domain.limits import (
    MAX_CONCURRENCY,
    MAX_TOKENS_PER_MINUTE,
    LimitRecord,
    limit_errors,
    share_overflow,
)


def make_record(
    *,
    tokens_per_minute: int = 100_000,
    max_concurrency: int = 8,
    guaranteed_share: float = 0.25,
) -> LimitRecord:
    return LimitRecord(
        team="search",
        model="chat-7b",
        tokens_per_minute=tokens_per_minute,
        max_concurrency=max_concurrency,
        guaranteed_share=guaranteed_share,
    )


def params(errors: list[tuple[str, str]]) -> list[str]:
    return [param for param, _ in errors]


def test_limit_errors_empty_for_valid_record() -> None:
    assert limit_errors(make_record()) == []


@pytest.mark.parametrize("tokens_per_minute", [1, MAX_TOKENS_PER_MINUTE])
def test_limit_errors_accepts_tokens_per_minute_bounds(tokens_per_minute: int) -> None:
    assert limit_errors(make_record(tokens_per_minute=tokens_per_minute)) == []


@pytest.mark.parametrize("tokens_per_minute", [0, -1, MAX_TOKENS_PER_MINUTE + 1])
def test_limit_errors_rejects_tokens_per_minute_out_of_range(
    tokens_per_minute: int,
) -> None:
    errors = limit_errors(make_record(tokens_per_minute=tokens_per_minute))
    assert params(errors) == ["tokens_per_minute"]
    assert str(MAX_TOKENS_PER_MINUTE) in errors[0][1]


@pytest.mark.parametrize("max_concurrency", [1, MAX_CONCURRENCY])
def test_limit_errors_accepts_concurrency_bounds(max_concurrency: int) -> None:
    assert limit_errors(make_record(max_concurrency=max_concurrency)) == []


@pytest.mark.parametrize("max_concurrency", [0, -3, MAX_CONCURRENCY + 1, 2**63])
def test_limit_errors_rejects_concurrency_out_of_range(max_concurrency: int) -> None:
    errors = limit_errors(make_record(max_concurrency=max_concurrency))
    assert errors == [("max_concurrency", f"must be between 1 and {MAX_CONCURRENCY}")]


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_limit_errors_accepts_share_between_zero_and_one(share: float) -> None:
    assert limit_errors(make_record(guaranteed_share=share)) == []


@pytest.mark.parametrize("share", [-0.01, 1.01, 2.0, math.nan, math.inf])
def test_limit_errors_rejects_share_outside_unit_interval(share: float) -> None:
    errors = limit_errors(make_record(guaranteed_share=share))
    assert params(errors) == ["guaranteed_share"]


def test_limit_errors_reports_every_bad_field() -> None:
    record = make_record(tokens_per_minute=0, max_concurrency=0, guaranteed_share=1.5)
    assert params(limit_errors(record)) == [
        "tokens_per_minute",
        "max_concurrency",
        "guaranteed_share",
    ]


def test_share_overflow_zero_without_shares() -> None:
    assert share_overflow([]) == 0.0


def test_share_overflow_zero_under_the_pool() -> None:
    assert share_overflow([0.25, 0.25, 0.4]) == 0.0


def test_share_overflow_zero_for_exact_whole_pool() -> None:
    assert share_overflow([0.5, 0.5]) == 0.0
    assert share_overflow([1.0]) == 0.0


def test_share_overflow_allows_tenths_summing_to_one() -> None:
    assert share_overflow([0.1, 0.2, 0.7]) == 0.0


def test_share_overflow_absorbs_float_rounding_above_one() -> None:
    shares = [0.34, 0.56, 0.1]
    # The float sum really lands above 1.0; only the epsilon lets it through.
    assert sum(shares) > 1.0
    assert share_overflow(shares) == 0.0


def test_share_overflow_rejects_sum_above_one() -> None:
    assert share_overflow([0.6, 0.5]) == pytest.approx(0.1)


def test_share_overflow_reports_amount_over_the_pool() -> None:
    assert share_overflow([1.0, 1.0, 0.5]) == pytest.approx(1.5)


def test_share_overflow_accepts_any_iterable() -> None:
    assert share_overflow(s for s in (0.7, 0.7)) == pytest.approx(0.4)
