"""Tests for the retry budget, on an explicit clock."""

from __future__ import annotations

from typing import TypedDict

import pytest

from routing.domain.retry_budget import RetryBudget


class BudgetSettings(TypedDict, total=False):
    """Keyword arguments of ``RetryBudget``."""

    ratio: float
    window_s: float
    min_retries: int


T0 = 10_000.0


def spend_all(budget: RetryBudget, now: float) -> int:
    spent = 0
    while budget.try_spend(now):
        spent += 1
        assert spent < 10_000, "budget never ran out"
    return spent


def test_retry_budget_allows_min_retries_at_low_volume() -> None:
    budget = RetryBudget(ratio=0.1, window_s=60.0, min_retries=3)
    for i in range(5):
        budget.record_request(T0 + i)
    assert spend_all(budget, T0 + 5) == 3


def test_retry_budget_allows_min_retries_with_no_traffic() -> None:
    assert spend_all(RetryBudget(), T0) == 3


def test_retry_budget_allows_ten_percent_at_high_volume() -> None:
    budget = RetryBudget(ratio=0.1, window_s=60.0, min_retries=3)
    for i in range(1_000):
        budget.record_request(T0 + i * 0.05)  # 1,000 requests over 50 s
    assert spend_all(budget, T0 + 50) == 100
    assert budget.counts(T0 + 50) == (1_000, 100)


def test_retry_budget_retries_do_not_grow_the_budget() -> None:
    budget = RetryBudget(ratio=0.5, min_retries=0)
    for _ in range(10):
        budget.record_request(T0)
    assert spend_all(budget, T0) == 5
    assert budget.counts(T0) == (10, 5)


def test_retry_budget_window_expiry_forgets_old_requests_and_retries() -> None:
    budget = RetryBudget(ratio=0.1, window_s=60.0, min_retries=3)
    for _ in range(1_000):
        budget.record_request(T0)
    assert spend_all(budget, T0) == 100
    # Still inside the window: nothing left.
    assert not budget.try_spend(T0 + 59)
    # The window has moved past T0: only the minimum is available again.
    assert budget.counts(T0 + 61) == (0, 0)
    assert spend_all(budget, T0 + 61) == 3


def test_retry_budget_window_slides_bucket_by_bucket() -> None:
    budget = RetryBudget(ratio=1.0, window_s=60.0, min_retries=0)
    for second in range(60):
        budget.record_request(T0 + second)
    assert budget.counts(T0 + 59) == (60, 0)
    assert budget.counts(T0 + 69) == (50, 0)
    assert budget.counts(T0 + 200) == (0, 0)


def test_retry_budget_memory_is_bounded_by_the_bucket_count() -> None:
    budget = RetryBudget()
    for i in range(100_000):
        budget.record_request(T0 + i * 0.01)
        budget.try_spend(T0 + i * 0.01)
    assert len(budget._buckets) <= 60


def test_retry_budget_clock_going_back_counts_in_the_newest_bucket() -> None:
    budget = RetryBudget(ratio=1.0, min_retries=0)
    budget.record_request(T0 + 30)
    budget.record_request(T0)
    assert budget.counts(T0 + 30) == (2, 0)
    assert budget.counts(T0 + 89) == (2, 0)
    assert budget.counts(T0 + 90) == (0, 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ratio": -0.1},
        {"window_s": 0.0},
        {"window_s": float("inf")},
        {"min_retries": -1},
    ],
)
def test_retry_budget_rejects_bad_settings(kwargs: BudgetSettings) -> None:
    with pytest.raises(ValueError):
        RetryBudget(**kwargs)
