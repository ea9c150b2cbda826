"""Tests for usage-row helpers: minute keys, counter sums, hit rate and cost."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from metering.domain.usage import (
    COUNTER_FIELDS,
    PART_OF,
    UsageCounts,
    prefix_hit_rate,
    truncate_to_minute,
    usd_per_million_tokens,
)


def test_truncate_to_minute_drops_seconds_and_microseconds() -> None:
    moment = datetime(2025, 3, 1, 12, 34, 56, 789_000, tzinfo=UTC)
    assert truncate_to_minute(moment) == datetime(2025, 3, 1, 12, 34, tzinfo=UTC)


def test_truncate_to_minute_keeps_timezone() -> None:
    moment = datetime(2025, 3, 1, 12, 34, 56, tzinfo=UTC)
    assert truncate_to_minute(moment).tzinfo is UTC


def test_truncate_to_minute_is_idempotent_on_minute_start() -> None:
    start = datetime(2025, 3, 1, 12, 34, tzinfo=UTC)
    assert truncate_to_minute(start) == start


def test_truncate_to_minute_last_instant_stays_in_its_minute() -> None:
    moment = datetime(2025, 3, 1, 12, 59, 59, 999_999, tzinfo=UTC)
    assert truncate_to_minute(moment) == datetime(2025, 3, 1, 12, 59, tzinfo=UTC)


def test_usage_counts_default_to_zero() -> None:
    assert UsageCounts() == UsageCounts(0, 0, 0, 0, 0, 0, 0, 0, 0)


def test_usage_counts_add_every_field() -> None:
    first = UsageCounts(
        prompt_tokens=100,
        cached_tokens=40,
        output_tokens=20,
        requests=1,
        shed=0,
        rate_limited=2,
        batch_requests=1,
        batch_prompt_tokens=60,
        batch_output_tokens=9,
    )
    second = UsageCounts(
        prompt_tokens=5,
        cached_tokens=1,
        output_tokens=7,
        requests=3,
        shed=4,
        rate_limited=0,
        batch_requests=2,
        batch_prompt_tokens=3,
        batch_output_tokens=0,
    )
    assert first + second == UsageCounts(
        prompt_tokens=105,
        cached_tokens=41,
        output_tokens=27,
        requests=4,
        shed=4,
        rate_limited=2,
        batch_requests=3,
        batch_prompt_tokens=63,
        batch_output_tokens=9,
    )


def test_usage_counts_add_sums_each_field_by_name() -> None:
    # Distinct powers of ten per field: a field added to the wrong one shows.
    first = UsageCounts(**{f: 10**i for i, f in enumerate(COUNTER_FIELDS)})
    second = UsageCounts(**{f: 2 * 10**i for i, f in enumerate(COUNTER_FIELDS)})
    assert first + second == UsageCounts(
        **{f: 3 * 10**i for i, f in enumerate(COUNTER_FIELDS)}
    )


def test_counter_fields_carry_the_batch_parts() -> None:
    assert {"batch_requests", "batch_prompt_tokens", "batch_output_tokens"} <= set(
        COUNTER_FIELDS
    )
    assert {part for part, _ in PART_OF} >= {
        "batch_requests",
        "batch_prompt_tokens",
        "batch_output_tokens",
    }
    assert all(whole in COUNTER_FIELDS for _, whole in PART_OF)


def test_usage_counts_zero_is_identity() -> None:
    counts = UsageCounts(prompt_tokens=9, output_tokens=3, requests=1)
    assert counts + UsageCounts() == counts
    assert UsageCounts() + counts == counts


def test_usage_counts_sum_with_start_value() -> None:
    rows = [UsageCounts(requests=1, output_tokens=10)] * 3
    assert sum(rows, UsageCounts()) == UsageCounts(requests=3, output_tokens=30)


def test_prefix_hit_rate_is_cached_share_of_prompt() -> None:
    assert prefix_hit_rate(prompt_tokens=200, cached_tokens=50) == 0.25


def test_prefix_hit_rate_zero_without_cache_hits() -> None:
    assert prefix_hit_rate(prompt_tokens=200, cached_tokens=0) == 0.0


@pytest.mark.parametrize("prompt_tokens", [0, -1])
def test_prefix_hit_rate_none_without_traffic(prompt_tokens: int) -> None:
    assert prefix_hit_rate(prompt_tokens=prompt_tokens, cached_tokens=0) is None


def test_prefix_hit_rate_capped_at_one() -> None:
    assert prefix_hit_rate(prompt_tokens=100, cached_tokens=150) == 1.0


def test_usd_per_million_tokens_reproduces_seed_figure() -> None:
    # 2.50 USD per GPU-hour, 1 GPU, 2,500 tok/s x 3,600 s = 9 M tokens an hour.
    tokens_per_hour = 2_500 * 3_600
    assert tokens_per_hour == 9_000_000
    cost = usd_per_million_tokens(2.50, 1, tokens_per_hour)
    assert cost == pytest.approx(2.5 / 9)
    assert round(cost, 2) == 0.28


def test_usd_per_million_tokens_doubles_when_half_busy() -> None:
    cost = usd_per_million_tokens(2.50, 1, 4_500_000)
    assert round(cost, 2) == 0.56


def test_usd_per_million_tokens_scales_with_gpus() -> None:
    one = usd_per_million_tokens(2.50, 1, 9_000_000)
    assert usd_per_million_tokens(2.50, 4, 9_000_000) == pytest.approx(4 * one)


@pytest.mark.parametrize("tokens_per_hour", [0, 0.0, -1.0])
def test_usd_per_million_tokens_rejects_non_positive_throughput(
    tokens_per_hour: float,
) -> None:
    with pytest.raises(ValueError, match="tokens_per_hour must be positive"):
        usd_per_million_tokens(2.50, 1, tokens_per_hour)
