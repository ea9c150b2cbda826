"""Usage rows are per team, model, version and minute; these helpers keep them honest.

Public surface: ``UsageCounts``, ``truncate_to_minute``, ``prefix_hit_rate``,
``usd_per_million_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

__all__ = [
    "UsageCounts",
    "prefix_hit_rate",
    "truncate_to_minute",
    "usd_per_million_tokens",
]


@dataclass(frozen=True, slots=True)
class UsageCounts:
    """The counters of one usage row; ``cached_tokens`` is part of ``prompt_tokens``."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0
    shed: int = 0
    rate_limited: int = 0

    def __add__(self, other: UsageCounts) -> UsageCounts:
        return UsageCounts(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            requests=self.requests + other.requests,
            shed=self.shed + other.shed,
            rate_limited=self.rate_limited + other.rate_limited,
        )


def truncate_to_minute(moment: datetime) -> datetime:
    """Return the start of the minute holding ``moment`` (the usage row's key)."""
    return moment.replace(second=0, microsecond=0)


def prefix_hit_rate(prompt_tokens: int, cached_tokens: int) -> float | None:
    """Return the share of prompt tokens served from the prefix cache; None without traffic."""
    if prompt_tokens <= 0:
        return None
    return min(1.0, cached_tokens / prompt_tokens)


def usd_per_million_tokens(
    gpu_hour_usd: float, gpus: int, tokens_per_hour: float
) -> float:
    """Return the cost of a million output tokens (seed: 2.50 USD / 9 M tokens = 0.28)."""
    if tokens_per_hour <= 0:
        raise ValueError("tokens_per_hour must be positive")
    return gpu_hour_usd * gpus / tokens_per_hour * 1_000_000
