"""The eval runner's pure parts: answer lengths and the retry policy."""

from __future__ import annotations

import random

import pytest

from control.eval_run import (
    MAX_TOKENS,
    backoff_delay_s,
    max_tokens_for,
    retry_after_s,
)
from models_registry.domain.eval_gate import EvalItem


def item(category: str, reference: str) -> EvalItem:
    return EvalItem(
        id="x",
        messages=({"role": "user", "content": "q"},),
        reference=reference,
        category=category,
    )


def test_max_tokens_is_sized_per_category_and_by_a_long_reference() -> None:
    assert max_tokens_for(item("maths", "42")) == MAX_TOKENS["maths"]
    assert max_tokens_for(item("reasoning", "odd")) == MAX_TOKENS["reasoning"]
    assert max_tokens_for(item("long_output", "w " * 40)) == 256
    assert max_tokens_for(item("long_output", "w " * 300)) == 664


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": "0.5"}, 0.5),
        ({"retry-after": "3600"}, 60.0),
        ({"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}, None),
        ({"retry-after": "-1"}, None),
        ({"retry-after": "nan"}, None),
        ({}, None),
        (None, None),
    ],
)
def test_retry_after_reads_seconds_only(
    headers: dict[str, str] | None, seconds: float | None
) -> None:
    assert retry_after_s(headers) == seconds


def test_retry_after_is_the_least_wait() -> None:
    rng = random.Random(1)
    waits = [backoff_delay_s(attempt, 2.0, rng) for attempt in range(50)]
    assert min(waits) >= 2.0
    assert max(waits) <= 2.2
    assert len(set(waits)) > 40  # jittered, so clients do not come back together


def test_backoff_grows_to_its_cap_with_jitter() -> None:
    rng = random.Random(2)
    first = [backoff_delay_s(0, None, rng) for _ in range(100)]
    assert all(0.125 <= w <= 0.25 for w in first)
    late = [backoff_delay_s(12, None, rng) for _ in range(100)]
    assert all(5.0 <= w <= 10.0 for w in late)
    assert max(late) - min(late) > 2.0
