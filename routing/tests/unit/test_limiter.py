"""Tests for the token-bucket math, on an explicit clock.

Most cases use a limit of 600 tokens per minute, which refills at exactly 10 tokens
per second, so every wait below is hand-computed.
"""

from __future__ import annotations

import math
from typing import TypedDict

import pytest

from routing.domain.limiter import (
    Bucket,
    Charge,
    ChargeTooLarge,
    charge,
    format_reset,
    rate_limit_headers,
    refill,
    refund,
)

T0 = 1_000.0
CAP = 600
RATE = CAP / 60  # 10 tokens per second


class Limits(TypedDict):
    """A bucket's limits, as the keyword arguments of the bucket functions."""

    capacity: int
    refill_per_s: float


class ChargeArgs(Limits):
    """The keyword arguments of ``charge`` and ``refund``, but the bucket and time."""

    amount: int


LIMITS: Limits = {"capacity": CAP, "refill_per_s": RATE}


def test_refill_none_is_a_full_bucket_created_now() -> None:
    assert refill(None, T0, **LIMITS) == Bucket(600.0, T0)


def test_refill_is_continuous_not_stepped() -> None:
    empty = Bucket(0.0, T0)
    assert refill(empty, T0 + 0.5, **LIMITS) == Bucket(5.0, T0 + 0.5)
    assert refill(empty, T0 + 3, **LIMITS) == Bucket(30.0, T0 + 3)
    assert refill(empty, T0 + 59.9, **LIMITS).tokens == pytest.approx(599.0)


def test_refill_caps_at_capacity() -> None:
    assert refill(Bucket(100.0, T0), T0 + 120, **LIMITS) == Bucket(600.0, T0 + 120)


def test_refill_clock_going_backwards_refills_nothing_and_keeps_updated_at() -> None:
    bucket = Bucket(100.0, T0)
    assert refill(bucket, T0 - 30, **LIMITS) == Bucket(100.0, T0)
    # When the clock catches up, only the time after T0 counts.
    assert refill(bucket, T0 + 10, **LIMITS) == Bucket(200.0, T0 + 10)


def test_refill_cuts_a_bucket_above_a_lowered_capacity() -> None:
    assert refill(Bucket(900.0, T0), T0, **LIMITS) == Bucket(600.0, T0)


def test_charge_allowed_takes_the_amount() -> None:
    result = charge(None, T0, amount=250, **LIMITS)
    assert result == Charge(
        allowed=True,
        bucket=Bucket(350.0, T0),
        limit=600,
        remaining=350,
        retry_after_s=0,
        reset_s=25.0,
    )


def test_charge_exactly_capacity_from_full_is_allowed() -> None:
    result = charge(None, T0, amount=600, **LIMITS)
    assert result.allowed
    assert result.remaining == 0
    assert result.reset_s == 60.0


def test_charge_refused_takes_nothing_but_refills_to_now() -> None:
    result = charge(Bucket(50.0, T0 - 5), T0, amount=250, **LIMITS)
    assert result == Charge(
        allowed=False,
        bucket=Bucket(100.0, T0),
        limit=600,
        remaining=100,
        retry_after_s=15,  # (250 - 100) / 10
        reset_s=50.0,  # (600 - 100) / 10
    )


@pytest.mark.parametrize(
    ("tokens", "amount", "retry_after_s"),
    [
        (100.0, 250, 15),  # 15.0 s exactly
        (100.0, 255, 16),  # 15.5 s rounds up
        (0.0, 600, 60),  # empty to full
        (249.99, 250, 1),  # 0.001 s is still at least 1
        (0.0, 1, 1),  # 0.1 s
        (0.0, 10, 1),  # 1.0 s exactly
        (0.0, 11, 2),  # 1.1 s
    ],
)
def test_charge_retry_after_is_exact_whole_seconds(
    tokens: float, amount: int, retry_after_s: int
) -> None:
    result = charge(Bucket(tokens, T0), T0, amount=amount, **LIMITS)
    assert not result.allowed
    assert result.retry_after_s == retry_after_s


def test_charge_retry_after_is_exact_when_the_rate_is_not_a_round_float() -> None:
    # 1,000 tokens per minute is 16.666... per second: 100 tokens take 6 s, and
    # float rounding must not make that 7.
    limits: Limits = {"capacity": 1000, "refill_per_s": 1000 / 60}
    refused = charge(Bucket(0.0, T0), T0, amount=100, **limits)
    assert refused.retry_after_s == 6
    assert not charge(refused.bucket, T0 + 5.9, amount=100, **limits).allowed
    assert charge(refused.bucket, T0 + 6, amount=100, **limits).allowed


def test_charge_tolerates_float_rounding_in_the_refill() -> None:
    # 492 tokens per minute is 8.2 per second, which floats cannot hold exactly:
    # 123 tokens take 15.000000000000002 s, and 15 s refill 122.99999999999999.
    limits: Limits = {"capacity": 492, "refill_per_s": 492 / 60}
    refused = charge(Bucket(0.0, T0), T0, amount=123, **limits)
    assert refused.retry_after_s == 15
    allowed = charge(refused.bucket, T0 + 15, amount=123, **limits)
    assert allowed.allowed
    assert allowed.remaining == 0
    too_much = charge(refused.bucket, T0 + 15, amount=124, **limits)
    assert not too_much.allowed
    assert too_much.remaining == 123


@pytest.mark.parametrize("amount", [1, 7, 99, 250, 333, 599, 600])
def test_charge_succeeds_after_retry_after_and_not_a_second_before(
    amount: int,
) -> None:
    start = Bucket(0.0, T0)
    refused = charge(start, T0, amount=amount, **LIMITS)
    wait = refused.retry_after_s
    assert charge(refused.bucket, T0 + wait, amount=amount, **LIMITS).allowed
    if wait > 1:
        early = charge(refused.bucket, T0 + wait - 1, amount=amount, **LIMITS)
        assert not early.allowed


def test_charge_repeated_refusals_do_not_push_the_client_back() -> None:
    bucket = Bucket(0.0, T0)
    for second in range(5):
        result = charge(bucket, T0 + second, amount=100, **LIMITS)
        assert not result.allowed
        bucket = result.bucket
    assert charge(bucket, T0 + 10, amount=100, **LIMITS).allowed


def test_charge_remaining_is_the_floor_of_fractional_tokens() -> None:
    result = charge(Bucket(0.0, T0), T0 + 0.25, amount=1, **LIMITS)  # 2.5 - 1
    assert result.allowed
    assert result.bucket.tokens == 1.5
    assert result.remaining == 1


def test_charge_larger_than_capacity_raises_charge_too_large() -> None:
    with pytest.raises(ChargeTooLarge, match="601 tokens") as excinfo:
        charge(None, T0, amount=601, **LIMITS)
    assert isinstance(excinfo.value, ValueError)
    assert "600 tokens per minute" in str(excinfo.value)
    assert (excinfo.value.amount, excinfo.value.capacity) == (601, 600)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 600, "refill_per_s": 10.0, "amount": -1},
        {"capacity": 0, "refill_per_s": 10.0, "amount": 0},
        {"capacity": 600, "refill_per_s": 0.0, "amount": 1},
        {"capacity": 600, "refill_per_s": math.inf, "amount": 1},
    ],
)
def test_charge_rejects_invalid_arguments(kwargs: ChargeArgs) -> None:
    with pytest.raises(ValueError) as excinfo:
        charge(None, T0, **kwargs)
    assert not isinstance(excinfo.value, ChargeTooLarge)


def test_refund_returns_unused_tokens() -> None:
    charged = charge(None, T0, amount=250, **LIMITS).bucket  # prompt + max_tokens
    assert refund(charged, T0, amount=100, **LIMITS) == Bucket(450.0, T0)


def test_refund_adds_refill_since_the_charge() -> None:
    charged = Bucket(350.0, T0)
    assert refund(charged, T0 + 10, amount=100, **LIMITS) == Bucket(550.0, T0 + 10)


@pytest.mark.parametrize(
    ("bucket", "now", "amount"),
    [
        (Bucket(550.0, T0), T0, 100),  # 650 would overflow
        (Bucket(350.0, T0), T0 + 30, 100),  # refill alone reaches 650
        (Bucket(600.0, T0), T0, 600),
    ],
)
def test_refund_never_goes_above_capacity(
    bucket: Bucket, now: float, amount: int
) -> None:
    assert refund(bucket, now, amount=amount, **LIMITS).tokens == 600.0


def test_refund_none_is_full() -> None:
    assert refund(None, T0, amount=50, **LIMITS) == Bucket(600.0, T0)


def test_refund_rejects_a_negative_amount() -> None:
    with pytest.raises(ValueError, match="amount"):
        refund(Bucket(0.0, T0), T0, amount=-5, **LIMITS)


def test_charge_then_refund_bills_only_the_tokens_used() -> None:
    """GIVEN a full bucket WHEN a request charges prompt + max_tokens and uses less
    THEN after the refund the bucket is short only the tokens used."""
    prompt_tokens, max_tokens, used = 120, 380, 200
    charged = charge(None, T0, amount=prompt_tokens + max_tokens, **LIMITS)
    assert charged.remaining == 100
    after = refund(charged.bucket, T0, amount=500 - used, **LIMITS)
    assert after.tokens == 600.0 - used


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (360.0, "6m0s"),
        (1.0, "1s"),
        (0.25, "250ms"),
        (0.07, "70ms"),  # 0.07 * 1000 is 70.00000000000001 in floats
        (0.0, "0s"),
        (-3.0, "0s"),
        (math.nan, "0s"),
        (0.0001, "1ms"),
        (0.9996, "1s"),
        (1.2, "2s"),
        (25.0, "25s"),
        (59.5, "1m0s"),
        (61.0, "1m1s"),
        (3600.0, "1h0m0s"),
        (3725.0, "1h2m5s"),
    ],
)
def test_format_reset_uses_openai_duration_style(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_rate_limit_headers_after_an_allowed_charge() -> None:
    result = charge(None, T0, amount=250, **LIMITS)
    assert rate_limit_headers(result) == {
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "350",
        "x-ratelimit-reset-tokens": "25s",
    }


def test_rate_limit_headers_after_a_refused_charge() -> None:
    result = charge(Bucket(0.0, T0), T0 + 0.5, amount=250, **LIMITS)
    assert rate_limit_headers(result) == {
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "5",
        "x-ratelimit-reset-tokens": "1m0s",  # 59.5 s rounded up
    }
