"""What a gateway process does while Redis is unreachable, and how it comes back.

Public surface: ``FailoverLimits``, ``RedisFailover``.

With Redis, a region's gateway processes share the team limits (buckets and
concurrency slots), live load and usage counts through it. When Redis stops
answering, serving goes on, each process on its own:

- limits: ``FailoverLimits`` enforces each team's limits in this process's memory
  (``routing.domain.limit_table``, as the embedded gateway does) at this process's
  share of them (``routing.domain.limit_share``: the limits split over the gateway
  processes last seen in the region), so the region stays within roughly the
  team's limits whichever process a request reaches;
- usage: ``metering.counters.FailoverUsageCounter`` sums in memory and adds the
  sums to Redis when it answers, so no usage row loses a request;
- routing: ``routing.live.LiveLoad`` judges liveness by the database heartbeats in
  the snapshot and takes its part of each pool.

Redis is probed by the live-load exchange, once a second, never per request: a
failed exchange (or a failed call on the hot path) switches to local at once, so
requests stop waiting on Redis; the first exchange that works switches back
(``RedisFailover.restore``). While Redis is up the hot path is unchanged: one
round trip per charge and per refund, as ``RedisLimits`` alone.

Going local, each process starts a team's bucket where it last saw the shared one
(refilled to now), at its share, rather than full: a team that had spent its
bucket does not get a fresh one for the outage. Coming back, the tokens each
process took locally (less what it refunded) are debited from the shared buckets
(``LimitStore.debit``, down to empty) before the switch, so the shared bucket does
not hand out again what was spent during the outage. Over an outage of D seconds
a region therefore serves a team at most about its bucket plus D seconds of its
rate, as with Redis (docs/sre.md#redis-outage-limits; the bound is tested in
routing/tests/test_failover.py). Requests admitted locally hold no shared slot:
for their remaining lifetime a team may have that many streams more than its cap.
Their refunds go to the shared bucket once their charges were debited there.
Refunds that Redis owed when it went away (requests charged there, ended during
the outage) are kept and replayed first, so no shared bucket stays charged and no
shared slot stays held until it expires.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from metering import metrics
from metering.counters import REDIS_ERRORS, FailoverUsageCounter
from routing.domain import limiter
from routing.domain.limit_share import LocalLimits, local_share
from routing.domain.limit_table import BucketTable, Claim, LimitTable, SlotTable
from routing.domain.limiter import Bucket
from routing.limiter_store import LimitStore

logger = logging.getLogger(__name__)

__all__ = ["FailoverLimits", "RedisFailover"]


@dataclass(frozen=True, slots=True)
class _Refund:
    """A refund (and slot release) that the shared store still owes."""

    key: str
    capacity: int
    refill_per_s: float
    amount: int
    request_id: str


@dataclass(slots=True)
class _Spent:
    """Tokens a key's bucket gave out locally in this outage (less refunds)."""

    capacity: int
    refill_per_s: float
    tokens: int = 0


class FailoverLimits:
    """Team limits in Redis; this process's share of them in memory while it is away.

    A ``LimitStore``. ``is_local`` has two writers: a call that fails on Redis and
    ``fall_back`` switch to local, ``restore`` switches back.
    """

    def __init__(
        self,
        shared: LimitStore,
        *,
        gateways: Callable[[], int],
        clock: Callable[[], float] = time.time,
        max_owed: int = 100_000,
        max_seen: int = 100_000,
    ) -> None:
        self.shared = shared
        self.gateways = gateways  # the gateway processes last seen in the region
        self.clock = clock
        self.max_owed = max_owed
        self.max_seen = max_seen
        # The shared bucket as the last claim through this process left it, by key:
        # where its local bucket starts in an outage.
        self._seen: dict[str, tuple[Bucket, int, float]] = {}
        # Keys whose local bucket this outage has started; tokens spent locally.
        self._started: set[str] = set()
        self._spent: dict[str, _Spent] = {}
        self.is_local = False
        self.share = 1  # the limits are split this many ways while local
        self._local = _new_table()
        self._outage = 0  # which outage the local table belongs to
        # Requests holding a local slot: request id -> (outage, limits charged).
        self._held_here: dict[str, tuple[int, LocalLimits]] = {}
        # Refunds of requests charged in Redis, to replay when it answers.
        self._owed: deque[_Refund] = deque()

    async def charge_and_acquire(
        self,
        key: str,
        *,
        capacity: int,
        refill_per_s: float,
        amount: int,
        limit: int,
        request_id: str,
        now: float,
        ttl_s: float = 900.0,
    ) -> Claim:
        """Charge ``amount`` to ``key``'s bucket and take a slot for ``request_id``.

        In Redis, or in this process (at its share) while Redis is away.

        Raises:
            ChargeTooLarge: ``amount > capacity``, as with Redis alone.
            ValueError: what the stores reject.
        """
        if not self.is_local:
            try:
                shared = await self.shared.charge_and_acquire(
                    key,
                    capacity=capacity,
                    refill_per_s=refill_per_s,
                    amount=amount,
                    limit=limit,
                    request_id=request_id,
                    now=now,
                    ttl_s=ttl_s,
                )
            except REDIS_ERRORS as exc:
                self.fall_back(exc)
                # The script may have run with its reply lost: free the slot it may
                # hold once Redis answers (tokens it took refill by themselves).
                self._owe(_Refund(key, capacity, refill_per_s, 0, request_id))
            else:
                self._see(key, shared.charge.bucket, capacity, refill_per_s)
                return shared
        limits = local_share(
            capacity=capacity,
            refill_per_s=refill_per_s,
            max_concurrency=limit,
            amount=amount,
            gateways=self.share,
        )
        if key not in self._started:
            self._start_local(key, limits, now)
        claim = self._local.charge_and_acquire(
            key,
            capacity=limits.capacity,
            refill_per_s=limits.refill_per_s,
            amount=amount,
            limit=limits.max_concurrency,
            request_id=request_id,
            now=now,
            ttl_s=ttl_s,
        )
        if claim.has_slot:
            self._held_here[request_id] = (self._outage, limits)
            spent = self._spent.get(key)
            if spent is None:
                spent = self._spent[key] = _Spent(capacity, refill_per_s)
            spent.tokens += amount
        return claim

    def _see(
        self, key: str, bucket: Bucket, capacity: int, refill_per_s: float
    ) -> None:
        seen = self._seen
        if key not in seen and len(seen) >= self.max_seen:
            del seen[next(iter(seen))]  # the oldest key first seen
        seen[key] = (bucket, capacity, refill_per_s)

    def _start_local(self, key: str, limits: LocalLimits, now: float) -> None:
        """Start ``key``'s local bucket at this process's share of the shared one.

        As the last claim through this process left it, refilled to ``now``; a key
        not seen here starts full (at its share), as an idle team's bucket is.
        """
        self._started.add(key)
        seen = self._seen.get(key)
        if seen is None:
            return
        bucket, capacity, refill_per_s = seen
        level = limiter.refill(
            bucket, now, capacity=capacity, refill_per_s=refill_per_s
        ).tokens
        share = min(float(limits.capacity), level / self.share)
        self._local.buckets.seed(
            key,
            Bucket(share, now),
            capacity=limits.capacity,
            refill_per_s=limits.refill_per_s,
        )

    async def refund_and_release(
        self,
        key: str,
        *,
        capacity: int,
        refill_per_s: float,
        amount: int,
        request_id: str,
        now: float,
    ) -> None:
        """Give ``amount`` tokens back and free the slot, where they were taken.

        A request charged locally in an outage that has ended gives its refund to
        the shared bucket (its charge was debited there); one charged in Redis
        while Redis is away is owed (replayed by ``restore``).
        """
        held = self._held_here.pop(request_id, None)
        if held is not None:
            outage, limits = held
            if self.is_local and outage == self._outage:
                self._local.refund_and_release(
                    key,
                    capacity=limits.capacity,
                    refill_per_s=limits.refill_per_s,
                    amount=amount,
                    request_id=request_id,
                    now=now,
                )
                spent = self._spent.get(key)
                if spent is not None:
                    spent.tokens = max(0, spent.tokens - amount)
                return
            # Its outage ended and its charge was debited from the shared bucket:
            # the unused part goes back there (it holds no slot there).
            request_id = ""
        refund = _Refund(key, capacity, refill_per_s, amount, request_id)
        if not self.is_local:
            try:
                await self._give_back(refund, now)
                return
            except REDIS_ERRORS as exc:
                self.fall_back(exc)
        self._owe(refund)

    async def debit(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> None:
        """Take ``amount`` tokens from ``key``'s bucket, in Redis or (away) here."""
        if not self.is_local:
            try:
                await self.shared.debit(
                    key,
                    capacity=capacity,
                    refill_per_s=refill_per_s,
                    amount=amount,
                    now=now,
                )
                return
            except REDIS_ERRORS as exc:
                self.fall_back(exc)
        spent = self._spent.setdefault(key, _Spent(capacity, refill_per_s))
        spent.tokens += amount  # owed to Redis when it answers
        self._local.debit(
            key,
            capacity=max(1, capacity // self.share),
            refill_per_s=refill_per_s / self.share,
            amount=amount,
            now=now,
        )

    def fall_back(self, reason: BaseException | None = None) -> None:
        """Enforce limits in this process from now on (Redis failed or is down)."""
        if self.is_local:
            return
        self.share = max(1, self.gateways())
        self._outage += 1
        self._local = _new_table()
        self._started = set()
        self.is_local = True
        metrics.set_limits_degraded(is_degraded=True)
        logger.warning(
            "Redis unreachable (%s): team limits are enforced in this process at "
            "1/%d of each limit until it answers",
            type(reason).__name__ if reason is not None else "exchange failed",
            self.share,
        )

    async def restore(self) -> bool:
        """Replay the refunds Redis owes, then share the limits through it again.

        Return True once back on Redis; False if Redis failed again (the refunds
        not replayed stay owed).
        """
        if not self.is_local:
            return True
        replayed = debited = 0
        try:
            # Refunds owed while this runs are appended and replayed too, and
            # tokens spent meanwhile debited; the switch below happens with no
            # await after the last check.
            while self._owed or self._spent:
                if self._owed:
                    await self._give_back(self._owed[0], self.clock())
                    self._owed.popleft()
                    replayed += 1
                    continue
                key, spent = next(iter(self._spent.items()))
                amount = spent.tokens
                if amount > 0:
                    await self.shared.debit(
                        key,
                        capacity=spent.capacity,
                        refill_per_s=spent.refill_per_s,
                        amount=amount,
                        now=self.clock(),
                    )
                    debited += amount
                # Spent during the await stays, for the next turn of the loop;
                # refunded during it was debited all the same: given back.
                spent.tokens -= amount
                if spent.tokens <= 0:
                    del self._spent[key]
                if spent.tokens < 0:
                    self._owe(
                        _Refund(
                            key, spent.capacity, spent.refill_per_s, -spent.tokens, ""
                        )
                    )
        except REDIS_ERRORS:
            return False
        unslotted = sum(
            1 for outage, _ in self._held_here.values() if outage == self._outage
        )
        self.is_local = False
        self._local = _new_table()
        metrics.set_limits_degraded(is_degraded=False)
        logger.warning(
            "Redis answers again: team limits are shared again (%d refunds replayed, "
            "%d tokens spent locally debited; %d requests admitted locally hold no "
            "shared slot)",
            replayed,
            debited,
            unslotted,
        )
        return True

    async def _give_back(self, refund: _Refund, now: float) -> None:
        await self.shared.refund_and_release(
            refund.key,
            capacity=refund.capacity,
            refill_per_s=refund.refill_per_s,
            amount=refund.amount,
            request_id=refund.request_id,
            now=now,
        )

    def _owe(self, refund: _Refund) -> None:
        if len(self._owed) >= self.max_owed:
            # Bounded: past it the oldest shared slot expires by its TTL instead.
            dropped = self._owed.popleft()
            logger.warning("dropping an owed refund of %s", dropped.key)
        self._owed.append(refund)


def _new_table() -> LimitTable:
    return LimitTable(BucketTable(), SlotTable())


class RedisFailover:
    """The parts of a gateway that fall back while Redis is away, switched together.

    The gateway calls ``fall_back`` when its live-load exchange fails and
    ``restore`` when one works (its probe of Redis), and reports ``health()`` in
    ``/healthz``.
    """

    def __init__(self, *, limits: FailoverLimits, usage: FailoverUsageCounter) -> None:
        self.limits = limits
        self.usage = usage

    @property
    def is_degraded(self) -> bool:
        """Return True while any part runs without Redis."""
        return self.limits.is_local or self.usage.is_local

    def fall_back(self, reason: BaseException | None = None) -> None:
        """Switch every part to local (Redis is known to be down)."""
        self.limits.fall_back(reason)
        self.usage.fall_back(reason)

    async def restore(self) -> None:
        """Switch back every part whose state Redis takes again (Redis answered)."""
        if not self.is_degraded:
            return
        # Each part stays local if Redis fails again in the middle; retried at the
        # next exchange.
        await self.usage.restore()
        await self.limits.restore()

    def health(self) -> dict[str, object]:
        """Return the ``/healthz`` fields of the limits and the usage counts."""
        limits = self.limits
        body: dict[str, object] = {
            "limits": "local" if limits.is_local else "shared",
            "usage": "buffered" if self.usage.is_local else "shared",
        }
        if limits.is_local:
            body["limit_share"] = round(1 / limits.share, 4)
        if self.usage.is_local:
            body["usage_buffered_rows"] = len(self.usage)
        return body

    async def stop(self) -> None:
        """At shutdown, push what usage waits in memory; log what cannot be pushed."""
        if not self.usage.is_local:
            return
        if await self.usage.restore():
            return
        lost = self.usage.drain()
        if lost:
            logger.error(
                "Redis unreachable at shutdown: %d usage rows counted in memory are "
                "lost: %s",
                len(lost),
                {str(key): counts for key, counts in lost.items()},
            )
