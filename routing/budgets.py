"""USD budgets in the gateway: reserve a request's worst case, settle its cost.

Public surface: ``BudgetStore``, ``MemoryBudgetStore``, ``FailoverBudgetStore``,
``BudgetGuard``, ``Reservation``.

Before admission, ``BudgetGuard.reserve`` prices the plan's worst case
(``routing.domain.budget.Price.worst_nano``) and reserves it against each budget
that covers the team and model (its budget on all models, its budget on the
model), in the region's counters (Redis, or this process's memory); a
reservation that would pass a hard limit is a 429 ``budget_exceeded`` with
Retry-After at the next calendar month (UTC). When the answer ends, ``settle``
moves each counter to what the usage cost (a refund of the rest). Nothing here
reads the database: the budgets, the month's flushed spend and the prices are
the snapshot's. Why this bounds the overshoot: docs/finance.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from metering import metrics
from metering.counters import REDIS_ERRORS
from metering.domain.cost import TokenWeights
from routing.domain.budget import (
    NANO_PER_USD,
    BudgetLedger,
    BudgetLine,
    Price,
    Reserved,
    budget_key,
    month_of,
    seconds_to_next_month,
    to_nano,
)
from routing.domain.snapshot import BudgetRecord, ConfigSnapshot
from routing.plan import ChatPlan
from routing.responses import FinalUsage, GatewayError

logger = logging.getLogger(__name__)

__all__ = [
    "BudgetGuard",
    "BudgetStore",
    "FailoverBudgetStore",
    "MemoryBudgetStore",
    "Reservation",
]

# A month's counter lives a day past its month (clock skew between hosts).
_TTL_MARGIN_S = 86_400


class BudgetStore(Protocol):
    """Where a region's budget counters live."""

    async def reserve(
        self, lines: Sequence[BudgetLine], amount: int, *, ttl_s: int
    ) -> Reserved:
        """Add ``amount`` to every line's counter unless one would pass its limit."""
        ...

    async def adjust(self, keys: Sequence[str], delta: int) -> None:
        """Add ``delta`` to the counters that exist."""
        ...


class MemoryBudgetStore:
    """This process's counters (the embedded gateway): a ``BudgetLedger``."""

    def __init__(self) -> None:
        self.ledger = BudgetLedger()

    async def reserve(
        self, lines: Sequence[BudgetLine], amount: int, *, ttl_s: int
    ) -> Reserved:
        reserved = self.ledger.reserve(lines, amount)
        if lines:
            self.ledger.forget_before(lines[0].key.rsplit(":", 1)[1])
        return reserved

    async def adjust(self, keys: Sequence[str], delta: int) -> None:
        self.ledger.adjust(keys, delta)


class FailoverBudgetStore:
    """Redis's counters, or this process's while a call to Redis fails.

    A reservation made in memory is settled in memory. While Redis is away each
    gateway process holds a team to its budget alone, from the snapshot's
    flushed spend: a region may then overshoot by what each process admits
    (docs/finance.md). A reservation left in Redis when it went away is never
    settled: its worst case stays counted (spend over-stated, never under).
    """

    def __init__(self, redis_store: BudgetStore) -> None:
        self.redis = redis_store
        self.memory = MemoryBudgetStore()

    async def reserve_where(
        self, lines: Sequence[BudgetLine], amount: int, *, ttl_s: int
    ) -> tuple[Reserved, BudgetStore]:
        """Reserve in Redis, or in memory if Redis fails; return where."""
        try:
            return await self.redis.reserve(lines, amount, ttl_s=ttl_s), self.redis
        except REDIS_ERRORS as exc:
            logger.warning("budgets kept in memory: %s", type(exc).__name__)
            return await self.memory.reserve(lines, amount, ttl_s=ttl_s), self.memory

    async def reserve(
        self, lines: Sequence[BudgetLine], amount: int, *, ttl_s: int
    ) -> Reserved:
        reserved, _ = await self.reserve_where(lines, amount, ttl_s=ttl_s)
        return reserved

    async def adjust(self, keys: Sequence[str], delta: int) -> None:
        await self.redis.adjust(keys, delta)


@dataclass(frozen=True, slots=True)
class Reservation:
    """What a request reserved: the counters, the amount, its price, and where."""

    keys: tuple[str, ...]
    amount_nano: int
    price: Price
    store: BudgetStore


class BudgetGuard:
    """Hold teams to their USD budgets (one per gateway)."""

    def __init__(
        self,
        *,
        store: BudgetStore,
        weights: TokenWeights | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.weights = weights or TokenWeights()
        self.clock = clock

    def lines(
        self, snapshot: ConfigSnapshot, team: str, model: str, now: float
    ) -> tuple[tuple[BudgetRecord, BudgetLine], ...]:
        """Return the budgets covering ``team`` on ``model`` with their lines."""
        month = month_of(now)
        found = []
        for key in ((team, ""), (team, model)):
            record = snapshot.budgets.get(key)
            if record is None:
                continue
            # A snapshot built last month knows nothing spent this month yet.
            current = record.month == month
            here = to_nano(record.spent_here_usd) if current else 0
            elsewhere = to_nano(record.spent_elsewhere_usd) if current else 0
            found.append(
                (
                    record,
                    BudgetLine(
                        key=budget_key(team, record.model, month),
                        limit_nano=to_nano(record.hard_usd) - elsewhere,
                        seed_nano=here,
                    ),
                )
            )
        return tuple(found)

    async def reserve(
        self, plan: ChatPlan, snapshot: ConfigSnapshot
    ) -> Reservation | None:
        """Reserve ``plan``'s worst case against its team's budgets; None if none.

        Raises:
            GatewayError: 429 ``budget_exceeded``, with Retry-After at the next
                month; nothing is reserved.
        """
        model, version = plan.resolution.model, plan.resolution.version
        now = self.clock()
        found = self.lines(snapshot, plan.team, model, now)
        if not found:
            return None
        record = snapshot.versions.get((model, version))
        model_record = snapshot.models.get(model)
        price = Price(
            usd_per_million=record.usd_per_million if record else 0.0,
            weights=self.weights,
            input_priced=model_record is not None and model_record.is_embedding,
        )
        amount = price.worst_nano(
            prompt_tokens=plan.prompt_tokens, output_tokens=plan.output_claim
        )
        lines = tuple(line for _, line in found)
        ttl_s = seconds_to_next_month(now) + _TTL_MARGIN_S
        store: BudgetStore = self.store
        if isinstance(store, FailoverBudgetStore):
            reserved, store = await store.reserve_where(lines, amount, ttl_s=ttl_s)
        else:
            reserved = await store.reserve(lines, amount, ttl_s=ttl_s)
        if not reserved.allowed:
            refused, line = found[reserved.refused]
            spent = reserved.spent_nano[reserved.refused]
            self._observe(refused, line, spent)
            metrics.count_budget_refusal(team=plan.team, model=refused.model)
            raise _exceeded(plan, refused, line, spent, amount, now)
        for (budget, line), spent in zip(found, reserved.spent_nano, strict=True):
            self._observe(budget, line, spent + amount)
        return Reservation(
            keys=tuple(line.key for line in lines),
            amount_nano=amount,
            price=price,
            store=store,
        )

    async def cancel(self, reservation: Reservation | None) -> None:
        """Give back a reservation whose request was never served (refused later)."""
        if reservation is None:
            return
        await self._adjust(reservation, -reservation.amount_nano)

    async def settle(
        self, reservation: Reservation | None, usage: FinalUsage | None
    ) -> None:
        """Move the counters from the reservation to what ``usage`` cost."""
        if reservation is None:
            return
        cost = 0
        if usage is not None:
            cost = reservation.price.cost_nano(
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=min(usage.cached_tokens, usage.prompt_tokens),
                output_tokens=usage.completion_tokens,
            )
        await self._adjust(reservation, cost - reservation.amount_nano)

    async def _adjust(self, reservation: Reservation, delta: int) -> None:
        try:
            await reservation.store.adjust(reservation.keys, delta)
        except Exception as exc:
            # The answer is complete: a failed settlement leaves the worst case
            # counted (spend over-stated), never breaks the connection.
            logger.warning("settling a budget failed: %s", type(exc).__name__)

    @staticmethod
    def _observe(record: BudgetRecord, line: BudgetLine, spent_nano: int) -> None:
        """Publish the budget's spend ratio over all regions and its thresholds."""
        if record.monthly_usd <= 0:
            return
        elsewhere = to_nano(record.hard_usd) - line.limit_nano
        ratio = (spent_nano + elsewhere) / NANO_PER_USD / record.monthly_usd
        metrics.set_budget_spend(
            team=record.team,
            model=record.model,
            spend_ratio=ratio,
            soft_ratio=record.soft_fraction,
            hard_ratio=record.hard_fraction,
        )


def _exceeded(
    plan: ChatPlan,
    record: BudgetRecord,
    line: BudgetLine,
    spent_nano: int,
    amount: int,
    now: float,
) -> GatewayError:
    elsewhere = to_nano(record.hard_usd) - line.limit_nano
    spent = (spent_nano + elsewhere) / NANO_PER_USD
    on = f"model {record.model!r}" if record.model else "all its models"
    return GatewayError(
        429,
        f"team {plan.team!r} has reached its budget on {on} for {line.key.rsplit(':', 1)[1]}: "
        f"{spent:.6f} USD spent or held by requests in flight, this request may cost "
        f"up to {amount / NANO_PER_USD:.6f} USD, and new requests stop at "
        f"{record.hard_usd:.6f} USD; it opens again next month, or when a platform "
        "admin raises the budget",
        code="budget_exceeded",
        error_type="rate_limit_error",
        headers={"retry-after": str(seconds_to_next_month(now))},
    )
