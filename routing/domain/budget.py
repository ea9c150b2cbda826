"""USD budgets at the gateway: what a request may cost, and the ledger that holds it.

Public surface: see ``__all__``.

A request is priced by the cost model's full-pool price (``metering.domain.cost``:
a team pays ``usd_per_million_at_full`` per million weighted tokens, what the
usage report bills it while its pool is not over capacity). Amounts are integer
nano-dollars, so a counter adds up exactly and a Redis ``INCRBY`` can hold it.

Admission reserves a request's worst case (its prompt as uncached, plus every
output token it may make) against each budget that covers it; the answer's end
settles the reservation to what the usage says it cost. A reservation is refused
when the budget's spend, reservations in flight included, plus it would pass the
hard limit. So settled spend never passes the hard limit in one region: the bound
of docs/finance.md, held by ``BudgetLedger`` here and ``routing.budget_redis``
(its Redis twin; ``routing/tests/test_budget_store.py`` holds them equal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from metering.domain.cost import TokenWeights

__all__ = [
    "NANO_PER_USD",
    "BudgetLedger",
    "BudgetLine",
    "Price",
    "Reserved",
    "budget_key",
    "month_of",
    "seconds_to_next_month",
    "to_nano",
]

NANO_PER_USD = 1_000_000_000


def to_nano(usd: float) -> int:
    """Return ``usd`` in whole nano-dollars (rounded down: a limit never grows)."""
    return math.floor(usd * NANO_PER_USD)


@dataclass(frozen=True, slots=True)
class Price:
    """What a token of one version costs in this region.

    ``usd_per_million`` is per million weighted tokens (output-token equivalents,
    ``TokenWeights``), or per million input tokens for an embedding model
    (``input_priced``), as the usage report prices them.
    """

    usd_per_million: float
    weights: TokenWeights
    input_priced: bool = False

    def cost_nano(
        self, *, prompt_tokens: int, cached_tokens: int, output_tokens: int
    ) -> int:
        """Return what a usage costs, rounded up to the nano-dollar."""
        if self.input_priced:
            weighted = float(prompt_tokens)
        else:
            weighted = self.weights.of(
                prompt_tokens=prompt_tokens,
                cached_tokens=cached_tokens,
                output_tokens=output_tokens,
            )
        return math.ceil(weighted * self.usd_per_million * 1000.0 - 1e-6)

    def worst_nano(self, *, prompt_tokens: int, output_tokens: int) -> int:
        """Return the most a request may cost: its prompt at the dearer of the
        cached and uncached weights, and every output token it may make."""
        weights = self.weights
        dearest = TokenWeights(
            prompt=max(weights.prompt, weights.cached),
            cached=max(weights.prompt, weights.cached),
            output=weights.output,
        )
        return Price(self.usd_per_million, dearest, self.input_priced).cost_nano(
            prompt_tokens=prompt_tokens, cached_tokens=0, output_tokens=output_tokens
        )


@dataclass(frozen=True, slots=True)
class BudgetLine:
    """One budget a request counts against, in one month.

    ``key`` names the month's counter; ``limit_nano`` is what this region's
    counter may reach (the hard limit less what other regions had spent when the
    snapshot was built); ``seed_nano`` is what the counter starts from when it is
    absent (this region's spend already flushed to the database this month).
    """

    key: str
    limit_nano: int
    seed_nano: int


@dataclass(frozen=True, slots=True)
class Reserved:
    """A reservation's outcome: allowed, or the index of the first line that
    refused it; ``spent_nano`` is each line's counter before it (reservations in
    flight included)."""

    allowed: bool
    spent_nano: tuple[int, ...]
    refused: int = -1


def budget_key(team: str, model: str, month: str) -> str:
    """Return the counter's key: ``model`` "" is the budget on all models."""
    return f"{team}:{model or '*'}:{month}"


def month_of(now: float) -> str:
    """Return the calendar month (UTC) of unix time ``now``: ``YYYY-MM``."""
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m")


def seconds_to_next_month(now: float) -> int:
    """Return the whole seconds from ``now`` to the next month's start (UTC), >= 1."""
    at = datetime.fromtimestamp(now, UTC)
    year, month = (at.year + 1, 1) if at.month == 12 else (at.year, at.month + 1)
    start = datetime(year, month, 1, tzinfo=UTC)
    return max(1, math.ceil(start.timestamp() - now))


class BudgetLedger:
    """Budget counters in memory: the embedded gateway's store, and the pure
    statement of what the Redis scripts do (one writer; not thread-safe)."""

    def __init__(self) -> None:
        self.spent: dict[str, int] = {}

    def reserve(self, lines: Sequence[BudgetLine], amount: int) -> Reserved:
        """Add ``amount`` to every line's counter if none would pass its limit;
        else change nothing and say which line refused.

        An absent counter starts at the line's seed.
        """
        current = tuple(self.spent.get(line.key, line.seed_nano) for line in lines)
        for index, (line, spent) in enumerate(zip(lines, current, strict=True)):
            if spent + amount > line.limit_nano:
                return Reserved(allowed=False, spent_nano=current, refused=index)
        for line, spent in zip(lines, current, strict=True):
            self.spent[line.key] = spent + amount
        return Reserved(allowed=True, spent_nano=current)

    def adjust(self, keys: Sequence[str], delta: int) -> None:
        """Add ``delta`` (a settlement: negative for a refund) to the counters that
        exist; an absent one (lost, or a new month) is left to its seed."""
        for key in keys:
            if key in self.spent:
                self.spent[key] += delta

    def forget_before(self, month: str) -> None:
        """Drop the counters of months before ``month`` (bounds the memory)."""
        for key in [k for k in self.spent if k.rsplit(":", 1)[1] < month]:
            del self.spent[key]
