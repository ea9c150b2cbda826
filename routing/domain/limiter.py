"""Token-bucket math for per-team tokens-per-minute limits (hc ``TokenBucket.authorize``
minus the ORM).

Public surface: ``Bucket``, ``Charge``, ``ChargeTooLarge``, ``refill``, ``charge``,
``refund``, ``format_reset``, ``rate_limit_headers``.

How a team's bucket works:

- A bucket holds at most ``capacity`` tokens (the team's ``tokens_per_minute``) and
  refills continuously at ``refill_per_s`` tokens per second; the gateway passes
  ``capacity / 60``, so an empty bucket is full again after one minute. Refill is
  computed lazily from ``updated_at`` whenever the bucket is touched, never by a
  timer.
- A missing bucket (``None``) is a full one created at ``now``: a new team may start
  with a full minute's burst.
- Limits count tokens, not requests, because one request can cost 100 times
  another. The gateway charges ``prompt_tokens + max_tokens`` up front, the most a
  request can use, so a stream never overruns the limit halfway; when the answer
  ends it refunds ``charged - used`` (the part of ``max_tokens`` not generated).
- A charge is all or nothing: a refused charge takes no tokens, so a client that
  retries later is not pushed further back by its own refusals.
- A charge larger than ``capacity`` can never succeed, so it raises
  ``ChargeTooLarge`` (a 400 naming the limit) instead of an eternal 429.
- The clock is passed in. A ``now`` earlier than ``updated_at`` (clock skew between
  gateways) refills nothing and keeps ``updated_at``, so the same seconds are never
  counted twice when the clock catches up.
- Comparisons allow a tolerance of a billionth of the capacity, so float rounding in
  ``capacity / 60`` never turns an exact hand-computed wait into one second more.
- Atomic storage (one bucket per team shared by every gateway) is the Redis
  adapter's job, not this module's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "Bucket",
    "Charge",
    "ChargeTooLarge",
    "charge",
    "format_reset",
    "rate_limit_headers",
    "refill",
    "refund",
]

# Relative tolerance on token levels and seconds; see the module docstring.
_TOLERANCE = 1e-9


@dataclass(frozen=True, slots=True)
class Bucket:
    """A team's token level at ``updated_at`` (seconds on the caller's clock)."""

    tokens: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class Charge:
    """The result of one charge attempt.

    ``bucket`` is the state to store: refilled to ``now`` and, if allowed, less the
    amount. ``remaining`` is the floor of its tokens. ``retry_after_s`` is 0 when
    allowed, else the whole seconds (rounded up, at least 1) until the bucket holds
    the amount. ``reset_s`` is the seconds until the bucket is full again.
    """

    allowed: bool
    bucket: Bucket
    limit: int
    remaining: int
    retry_after_s: int
    reset_s: float


class ChargeTooLarge(ValueError):
    """A charge exceeds the bucket's capacity, so no wait would ever allow it."""

    def __init__(
        self, amount: int, capacity: int, *, unit: str = "tokens per minute"
    ) -> None:
        super().__init__(
            f"this request needs {amount} tokens (prompt plus max_tokens) but the "
            f"limit is {capacity} {unit}; lower max_tokens or shorten the prompt"
        )
        self.amount = amount
        self.capacity = capacity


def refill(
    bucket: Bucket | None, now: float, *, capacity: int, refill_per_s: float
) -> Bucket:
    """Return ``bucket`` topped up to ``now``, never above ``capacity``.

    ``None`` is a full bucket created at ``now``. A clock that went backwards
    refills nothing and keeps ``updated_at`` (see the module docstring). A level
    above ``capacity`` (the limit was lowered) is cut to ``capacity``.
    """
    if bucket is None:
        return Bucket(float(capacity), now)
    elapsed = now - bucket.updated_at
    if elapsed <= 0:
        if bucket.tokens <= capacity:
            return bucket
        return Bucket(float(capacity), bucket.updated_at)
    return Bucket(min(float(capacity), bucket.tokens + elapsed * refill_per_s), now)


def charge(
    bucket: Bucket | None,
    now: float,
    *,
    capacity: int,
    refill_per_s: float,
    amount: int,
) -> Charge:
    """Take ``amount`` tokens from ``bucket`` at ``now`` if it holds them.

    Raises:
        ChargeTooLarge: ``amount > capacity``.
        ValueError: a negative amount, or a capacity or refill rate that is not
            positive.
    """
    _check_limits(capacity, refill_per_s)
    if amount < 0:
        raise ValueError("amount must be zero or more")
    if amount > capacity:
        raise ChargeTooLarge(amount, capacity)
    current = refill(bucket, now, capacity=capacity, refill_per_s=refill_per_s)
    slack = _TOLERANCE * capacity
    if current.tokens + slack >= amount:
        after = Bucket(max(0.0, current.tokens - amount), current.updated_at)
        return Charge(
            allowed=True,
            bucket=after,
            limit=capacity,
            remaining=_floor_tokens(after.tokens, slack),
            retry_after_s=0,
            reset_s=(capacity - after.tokens) / refill_per_s,
        )
    wait_s = (amount - current.tokens) / refill_per_s
    return Charge(
        allowed=False,
        bucket=current,
        limit=capacity,
        remaining=_floor_tokens(current.tokens, slack),
        retry_after_s=max(1, math.ceil(wait_s - _TOLERANCE * max(1.0, wait_s))),
        reset_s=(capacity - current.tokens) / refill_per_s,
    )


def refund(
    bucket: Bucket | None,
    now: float,
    *,
    capacity: int,
    refill_per_s: float,
    amount: int,
) -> Bucket:
    """Return ``amount`` unused tokens to ``bucket`` at ``now``, never above capacity.

    The gateway refunds ``charged - used`` when an answer ends; tokens that were
    charged but refilled meanwhile are not paid twice because of the cap.
    """
    _check_limits(capacity, refill_per_s)
    if amount < 0:
        raise ValueError("amount must be zero or more")
    current = refill(bucket, now, capacity=capacity, refill_per_s=refill_per_s)
    return Bucket(min(float(capacity), current.tokens + amount), current.updated_at)


def debit(
    bucket: Bucket | None,
    now: float,
    *,
    capacity: int,
    refill_per_s: float,
    amount: int,
) -> Bucket:
    """Return ``bucket`` at ``now`` less ``amount`` tokens, never below empty.

    A charge that is never refused: tokens already spent elsewhere (a gateway's
    own bucket while the shared one was away) are owed to the shared bucket, so
    that the team does not spend them twice. Any amount is taken, down to empty.
    """
    _check_limits(capacity, refill_per_s)
    if amount < 0:
        raise ValueError("amount must be zero or more")
    current = refill(bucket, now, capacity=capacity, refill_per_s=refill_per_s)
    return Bucket(max(0.0, current.tokens - amount), current.updated_at)


def format_reset(seconds: float) -> str:
    """Return ``seconds`` in OpenAI's ``x-ratelimit-reset-*`` style (Go durations).

    Under one second: whole milliseconds, rounded up (``"250ms"``). From one second:
    whole seconds, rounded up, as ``"1s"``, ``"6m0s"``, ``"1h0m0s"``. Zero or less
    (or NaN) is ``"0s"``. Rounding up means a client that waits that long finds the
    bucket reset.
    """
    if not seconds > 0:
        return "0s"
    millis = math.ceil(seconds * 1000 - _TOLERANCE * max(1.0, seconds * 1000))
    if millis < 1000:
        return f"{max(millis, 1)}ms"
    total_s = math.ceil(seconds - _TOLERANCE * seconds)
    hours, rest = divmod(total_s, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rate_limit_headers(charge: Charge) -> dict[str, str]:
    """Return the ``x-ratelimit-*-tokens`` headers OpenAI clients read.

    Sent on every answer, allowed or refused; the 429's ``Retry-After`` comes from
    ``Charge.retry_after_s`` and is the gateway's to add, with client jitter.
    """
    return {
        "x-ratelimit-limit-tokens": str(charge.limit),
        "x-ratelimit-remaining-tokens": str(charge.remaining),
        "x-ratelimit-reset-tokens": format_reset(charge.reset_s),
    }


def _check_limits(capacity: int, refill_per_s: float) -> None:
    if capacity <= 0:
        raise ValueError("capacity must be a positive number of tokens")
    if not (refill_per_s > 0 and math.isfinite(refill_per_s)):
        raise ValueError("refill_per_s must be a positive number of tokens")


def _floor_tokens(tokens: float, slack: float) -> int:
    # 99.99999999 left after float arithmetic is 100 tokens, not 99.
    return math.floor(tokens + slack)
