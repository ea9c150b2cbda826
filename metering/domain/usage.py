"""Usage rows are per team, model, version and minute; these helpers keep them honest.

Public surface: ``UsageCounts``, ``UsageKey``, ``UsageLedger``, ``COUNTER_FIELDS``,
``PART_OF``, ``truncate_to_minute``, ``prefix_hit_rate``, ``usd_per_million_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime

__all__ = [
    "COUNTER_FIELDS",
    "PART_OF",
    "UsageCounts",
    "UsageKey",
    "UsageLedger",
    "prefix_hit_rate",
    "truncate_to_minute",
    "usd_per_million_tokens",
]


@dataclass(frozen=True, slots=True)
class UsageCounts:
    """The counters of one usage row; ``cached_tokens`` is part of ``prompt_tokens``.

    ``batch_requests``, ``batch_prompt_tokens`` and ``batch_output_tokens`` are the
    part of ``requests``, ``prompt_tokens`` and ``output_tokens`` that was batch
    work (the batch tier, or a batch job's key at any tier): counted in the
    totals too, as batch tokens count against the team's tokens per minute.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0
    shed: int = 0
    rate_limited: int = 0
    batch_requests: int = 0
    batch_prompt_tokens: int = 0
    batch_output_tokens: int = 0

    def __add__(self, other: UsageCounts) -> UsageCounts:
        return UsageCounts(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            requests=self.requests + other.requests,
            shed=self.shed + other.shed,
            rate_limited=self.rate_limited + other.rate_limited,
            batch_requests=self.batch_requests + other.batch_requests,
            batch_prompt_tokens=self.batch_prompt_tokens + other.batch_prompt_tokens,
            batch_output_tokens=self.batch_output_tokens + other.batch_output_tokens,
        )


COUNTER_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(UsageCounts))
# Counters that count a part of another, as (part, whole): a usage row keeps
# part <= whole (``metering.counters.check_counts``, and the table's checks).
PART_OF: tuple[tuple[str, str], ...] = (
    ("cached_tokens", "prompt_tokens"),
    ("batch_requests", "requests"),
    ("batch_prompt_tokens", "prompt_tokens"),
    ("batch_output_tokens", "output_tokens"),
)


@dataclass(frozen=True, slots=True)
class UsageKey:
    """The key of one usage row: team, model and version slugs, and the minute.

    ``minute_epoch`` is the unix second at which the minute starts (a multiple of 60).
    """

    team: str
    model: str
    version: str
    minute_epoch: int

    def __post_init__(self) -> None:
        if self.minute_epoch % 60:
            raise ValueError(f"minute_epoch {self.minute_epoch} is not a minute start")

    @classmethod
    def from_time(cls, team: str, model: str, version: str, t: float) -> UsageKey:
        """Return the key of the minute holding unix time ``t``."""
        return cls(team, model, version, int(t // 60) * 60)

    @property
    def minute_at(self) -> datetime:
        """Return the start of the minute as an aware UTC datetime (the row's key)."""
        return datetime.fromtimestamp(self.minute_epoch, tz=UTC)


class UsageLedger:
    """Sum usage counts per key in memory, until drained.

    Its size is bounded by the keys of the minutes not yet drained (teams x models x
    versions per minute), never by the number of requests. Not thread-safe: one
    owner (an event loop, or a caller holding a lock).
    """

    def __init__(self) -> None:
        self._entries: dict[UsageKey, UsageCounts] = {}

    def add(self, key: UsageKey, counts: UsageCounts) -> None:
        """Add ``counts`` to the sums of ``key``."""
        current = self._entries.get(key)
        self._entries[key] = counts if current is None else current + counts

    def drain(
        self, before_minute_epoch: int | None = None
    ) -> dict[UsageKey, UsageCounts]:
        """Remove and return the entries of minutes starting before the given one.

        With ``None``, remove and return every entry, the open minute's included.
        """
        if before_minute_epoch is None:
            drained, self._entries = self._entries, {}
            return drained
        drained = {
            key: counts
            for key, counts in self._entries.items()
            if key.minute_epoch < before_minute_epoch
        }
        for key in drained:
            del self._entries[key]
        return drained

    def __len__(self) -> int:
        return len(self._entries)


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
