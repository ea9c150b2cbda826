"""Validation of a team's limits on one model, and of guaranteed shares across teams.

Public surface: ``LimitRecord``, ``limit_errors``, ``share_overflow``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "MAX_CONCURRENCY",
    "MAX_TOKENS_PER_MINUTE",
    "LimitRecord",
    "limit_errors",
    "share_overflow",
]

# Far above any pool's output (one 7B replica makes 150,000 tokens a minute); a
# bound keeps the token-bucket arithmetic in 64-bit integers.
MAX_TOKENS_PER_MINUTE = 10**12
# What the column holds (a 32-bit integer): more was a DataError, so a 500.
MAX_CONCURRENCY = 2**31 - 1


@dataclass(frozen=True, slots=True)
class LimitRecord:
    """A team's limits on one model (the seed's team_limits row)."""

    team: str
    model: str
    tokens_per_minute: int
    max_concurrency: int
    guaranteed_share: float


def limit_errors(record: LimitRecord) -> list[tuple[str, str]]:
    """Return (param, message) for every value that breaks a rule; empty when valid."""
    errors: list[tuple[str, str]] = []
    if not 0 < record.tokens_per_minute <= MAX_TOKENS_PER_MINUTE:
        errors.append(
            ("tokens_per_minute", f"must be between 1 and {MAX_TOKENS_PER_MINUTE}")
        )
    if not 0 < record.max_concurrency <= MAX_CONCURRENCY:
        errors.append(("max_concurrency", f"must be between 1 and {MAX_CONCURRENCY}"))
    if not 0.0 <= record.guaranteed_share <= 1.0:
        errors.append(("guaranteed_share", "must be a fraction between 0 and 1"))
    return errors


def share_overflow(shares: Iterable[float]) -> float:
    """Return by how much the guaranteed shares of one model exceed the whole pool.

    Guarantees are promises of capacity; promising more than 100% of a pool would
    make "interactive traffic inside a guarantee is never shed" impossible to keep.
    A small epsilon absorbs float sums such as 0.1 + 0.2.
    """
    total = sum(shares)
    return max(0.0, total - 1.0) if total > 1.0 + 1e-9 else 0.0
