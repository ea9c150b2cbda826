"""Token buckets and concurrency slots held in one process's memory.

Public surface: ``Claim``, ``BucketTable``, ``SlotTable``, ``LimitTable``,
``check_now``, ``check_ttl``.

These are the embedded gateway's limits (``routing.limiter_store`` wraps them in its
async store interface, beside the Redis stores that share a region's limits) and the
fleet simulator's: both charge and refund with exactly the same code. The bucket
arithmetic is ``routing.domain.limiter``'s; this module only keeps its state.

Calls are synchronous and never yield, so on one event loop (or in one simulation)
no two calls interleave: each is atomic. Time is always passed in, on the caller's
clock (unix seconds in the gateway, virtual seconds in the simulator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from routing.domain import limiter
from routing.domain.limiter import Bucket, Charge

__all__ = [
    "BucketTable",
    "Claim",
    "LimitTable",
    "SlotTable",
    "check_now",
    "check_ttl",
]


@dataclass(frozen=True, slots=True)
class Claim:
    """What charging a bucket and taking a concurrency slot together gave.

    ``has_slot`` is true only when the bucket allowed the charge and a slot was
    free: then the charge is stored and the slot held. Otherwise nothing is held.
    A charge the bucket refused stores only its refill, as ``charge`` does, and
    takes no slot. A charge the bucket allowed but the cap refused is not stored
    at all (the bucket is untouched); ``charge`` is then the charge of 0 tokens at
    ``now``: the bucket's level refilled to ``now``, what the rate-limit headers
    should show since nothing was taken.
    """

    charge: Charge
    has_slot: bool


def check_now(now: float) -> None:
    """Refuse a clock reading that is not finite.

    A NaN or infinite ``now`` would be stored and poison the bucket for good.
    """
    if not math.isfinite(now):
        raise ValueError("now must be a finite number of seconds")


def check_ttl(ttl_s: float) -> None:
    """Refuse a slot lifetime that is not a positive number of seconds."""
    if not (ttl_s > 0 and math.isfinite(ttl_s)):
        raise ValueError("ttl_s must be a positive number of seconds")


@dataclass(slots=True)
class _Entry:
    bucket: Bucket
    capacity: int
    refill_per_s: float


class BucketTable:
    """Token buckets by key.

    Memory is bounded by the buckets not yet full: every ``sweep_every`` charges,
    buckets that have refilled to capacity by that charge's ``now`` are dropped.
    Dropping one is invisible (an absent bucket is a full one), with the same two
    exceptions as an expired Redis key: it forgets the bucket's time (a later
    call with an earlier ``now`` starts from there), and fullness was judged by
    the limits of the bucket's last call, so after a limit is raised (or its
    refill slowed) a dropped bucket starts full at the new capacity, where a kept
    one would refill lazily towards it.
    """

    def __init__(self, *, sweep_every: int = 1024) -> None:
        if sweep_every < 1:
            raise ValueError("sweep_every must be 1 or more")
        self.sweep_every = sweep_every
        self._buckets: dict[str, _Entry] = {}
        self._charges = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def charge(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> Charge:
        """Refill the bucket to ``now`` and take ``amount`` if it holds that much.

        Raises:
            ChargeTooLarge: ``amount > capacity``; nothing is stored.
            ValueError: what ``limiter.charge`` rejects, or a ``now`` that is not
                finite; nothing is stored.
        """
        check_now(now)
        result = limiter.charge(
            self.stored(key),
            now,
            capacity=capacity,
            refill_per_s=refill_per_s,
            amount=amount,
        )
        self.store_charged(key, result.bucket, capacity, refill_per_s, now)
        return result

    def refund(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> None:
        """Give back ``amount`` tokens (never above ``capacity``)."""
        check_now(now)
        bucket = limiter.refund(
            self.stored(key),
            now,
            capacity=capacity,
            refill_per_s=refill_per_s,
            amount=amount,
        )
        self.seed(key, bucket, capacity=capacity, refill_per_s=refill_per_s)

    def debit(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> None:
        """Take ``amount`` tokens whatever the level, down to empty (``limiter.debit``)."""
        check_now(now)
        bucket = limiter.debit(
            self.stored(key),
            now,
            capacity=capacity,
            refill_per_s=refill_per_s,
            amount=amount,
        )
        self.seed(key, bucket, capacity=capacity, refill_per_s=refill_per_s)

    def seed(
        self, key: str, bucket: Bucket, *, capacity: int, refill_per_s: float
    ) -> None:
        """Store ``bucket`` as ``key``'s (a refund's or debit's result, or a level
        known elsewhere), without a sweep."""
        self._buckets[key] = _Entry(bucket, capacity, refill_per_s)

    def peek(
        self, key: str, *, capacity: int, refill_per_s: float, now: float
    ) -> Bucket:
        """Return the bucket as refilled to ``now``, without storing it."""
        return limiter.refill(
            self.stored(key), now, capacity=capacity, refill_per_s=refill_per_s
        )

    def stored(self, key: str) -> Bucket | None:
        """Return the bucket as last stored (None: absent, a full one)."""
        entry = self._buckets.get(key)
        return entry.bucket if entry else None

    def store_charged(
        self, key: str, bucket: Bucket, capacity: int, refill_per_s: float, now: float
    ) -> None:
        """Store the state a charge left, and sweep every ``sweep_every`` charges."""
        self._buckets[key] = _Entry(bucket, capacity, refill_per_s)
        self._charges += 1
        if self._charges % self.sweep_every == 0:
            self.sweep(now)

    def sweep(self, now: float) -> int:
        """Drop the buckets that are full at ``now``; return how many."""
        full = [
            key
            for key, entry in self._buckets.items()
            if limiter.refill(
                entry.bucket,
                now,
                capacity=entry.capacity,
                refill_per_s=entry.refill_per_s,
            ).tokens
            >= entry.capacity
        ]
        for key in full:
            del self._buckets[key]
        return len(full)


class SlotTable:
    """Concurrency slots by key: request ids with an expiry time.

    Memory is bounded: a key's expired slots are dropped whenever it is acquired,
    an empty key is dropped, and every ``sweep_every`` acquires all keys are
    swept, so slots that were never released (a bug, a lost task) go after
    ``ttl_s``.
    """

    def __init__(self, *, sweep_every: int = 1024) -> None:
        if sweep_every < 1:
            raise ValueError("sweep_every must be 1 or more")
        self.sweep_every = sweep_every
        # key -> request_id -> expiry time
        self._slots: dict[str, dict[str, float]] = {}
        self._acquires = 0

    def __len__(self) -> int:
        return len(self._slots)

    def acquire(
        self,
        key: str,
        *,
        limit: int,
        request_id: str,
        now: float,
        ttl_s: float = 900.0,
    ) -> bool:
        """Take a slot for ``request_id`` unless ``limit`` unexpired slots are held.

        A slot expires at ``now + ttl_s`` unless released first. Acquiring again
        with a ``request_id`` that holds a slot succeeds and extends its expiry.
        """
        check_now(now)
        check_ttl(ttl_s)
        self._acquires += 1
        if self._acquires % self.sweep_every == 0:
            self.sweep(now)
        slots = self._slots.get(key, {})
        _drop_expired(slots, now)
        # Same order as the Redis script: a holder re-acquires, else the count.
        allowed = request_id in slots or len(slots) < limit
        if allowed:
            slots[request_id] = now + ttl_s
        if slots:
            self._slots[key] = slots
        else:
            self._slots.pop(key, None)
        return allowed

    def release(self, key: str, *, request_id: str) -> None:
        """Free the slot of ``request_id`` (a no-op if it holds none)."""
        slots = self._slots.get(key)
        if slots is None:
            return
        slots.pop(request_id, None)
        if not slots:
            del self._slots[key]

    def count(self, key: str, now: float) -> int:
        """Return the number of slots held at ``now`` (unexpired)."""
        return sum(
            1 for expires_at in self._slots.get(key, {}).values() if expires_at > now
        )

    def sweep(self, now: float) -> None:
        """Drop expired slots everywhere, and keys left without slots."""
        for key in list(self._slots):
            slots = self._slots[key]
            _drop_expired(slots, now)
            if not slots:
                del self._slots[key]


class LimitTable:
    """A bucket charge and a concurrency slot per key, taken and given back together.

    Gives the same answers and leaves the same state as the Redis store's one
    script per call (``routing.limiter_redis.RedisLimits``).
    """

    def __init__(self, buckets: BucketTable, slots: SlotTable) -> None:
        self.buckets = buckets
        self.slots = slots

    def charge_and_acquire(
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

        Both or neither (see ``Claim``). The bucket is judged first: a refused
        charge never looks at the slots.

        Raises:
            ChargeTooLarge: ``amount > capacity``; nothing is touched.
            ValueError: a bad ``now``, ``ttl_s`` or limit; nothing is touched.
        """
        check_now(now)
        check_ttl(ttl_s)
        stored = self.buckets.stored(key)
        result = limiter.charge(
            stored, now, capacity=capacity, refill_per_s=refill_per_s, amount=amount
        )
        if result.allowed and not self.slots.acquire(
            key, limit=limit, request_id=request_id, now=now, ttl_s=ttl_s
        ):
            # The cap refused: the bucket stays as stored; report it untaken.
            untaken = limiter.charge(
                stored, now, capacity=capacity, refill_per_s=refill_per_s, amount=0
            )
            return Claim(untaken, has_slot=False)
        self.buckets.store_charged(key, result.bucket, capacity, refill_per_s, now)
        return Claim(result, has_slot=result.allowed)

    def refund_and_release(
        self,
        key: str,
        *,
        capacity: int,
        refill_per_s: float,
        amount: int,
        request_id: str,
        now: float,
    ) -> None:
        """Give ``amount`` tokens back (never above ``capacity``) and free the slot.

        A refund of 0 leaves the bucket as it is; freeing a slot that
        ``request_id`` does not hold is a no-op.
        """
        check_now(now)
        # Reject what the pure math rejects before anything is touched.
        limiter.refund(
            None, now, capacity=capacity, refill_per_s=refill_per_s, amount=amount
        )
        if amount > 0:
            self.buckets.refund(
                key,
                capacity=capacity,
                refill_per_s=refill_per_s,
                amount=amount,
                now=now,
            )
        self.slots.release(key, request_id=request_id)

    def debit(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> None:
        """Take ``amount`` tokens from the bucket whatever its level, down to empty."""
        self.buckets.debit(
            key, capacity=capacity, refill_per_s=refill_per_s, amount=amount, now=now
        )


def _drop_expired(slots: dict[str, float], now: float) -> None:
    # Expired means expires_at <= now, as ZREMRANGEBYSCORE -inf now (inclusive).
    for request_id in [rid for rid, at in slots.items() if at <= now]:
        del slots[request_id]
