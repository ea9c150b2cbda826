"""Where the gateway keeps its token buckets and concurrency slots.

Public surface: ``BucketStore``, ``ConcurrencyStore`` and ``LimitStore`` (the
protocols), ``MemoryBucketStore``, ``MemoryConcurrency``, ``MemoryLimits``, and
``Claim`` (from ``routing.domain.limit_table``). The Redis stores are in
``routing.limiter_redis``.

The arithmetic lives in ``routing.domain.limiter`` (pure). A store only keeps its
state: in memory (the embedded default, one process: async faces of
``routing.domain.limit_table``, which the fleet simulator uses directly) or in Redis
(shared by every gateway of a region, one Lua script per operation). Both give the
same ``Charge`` for the same history (``routing/tests/test_limiter_store.py``
checks this on random histories).

While Redis is unreachable, ``routing.failover.FailoverLimits`` keeps each team's
share of its limits in a ``LimitTable`` of this process instead.

Admission takes a bucket charge and a concurrency slot for every request and gives
both back when it ends, so a ``LimitStore`` (``buckets.pair(slots)``) does each pair
in one step: ``charge_and_acquire`` and ``refund_and_release``, one Redis round
trip each.

Time is passed in by the caller (``now``, unix seconds) and never read here, so
every store runs on an injected clock in tests. This module is async-side code: it
imports no models.
"""

from __future__ import annotations

from typing import Protocol

from routing.domain.limit_table import BucketTable, Claim, LimitTable, SlotTable
from routing.domain.limiter import Bucket, Charge

__all__ = [
    "BucketStore",
    "Claim",
    "ConcurrencyStore",
    "LimitStore",
    "MemoryBucketStore",
    "MemoryConcurrency",
    "MemoryLimits",
]


class BucketStore(Protocol):
    """Charge and refund token buckets by key, atomically per call."""

    async def charge(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> Charge:
        """Refill the bucket to ``now`` and take ``amount`` if it holds that much.

        Raises:
            ChargeTooLarge: ``amount > capacity`` (no bucket could ever allow it);
                the stored state is left untouched.
            ValueError: what ``limiter.charge`` rejects, or a ``now`` that is not
                finite; the stored state is left untouched.
        """
        ...

    async def refund(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> None:
        """Give back ``amount`` tokens (never above ``capacity``)."""
        ...

    def pair(self, slots: ConcurrencyStore) -> LimitStore:
        """Return the store that charges here and takes ``slots`` in one step.

        Raises:
            TypeError: ``slots`` is not kept where this store keeps its buckets.
        """
        ...


class LimitStore(Protocol):
    """A bucket charge and a concurrency slot per key, taken and given back together.

    Each call is atomic: no other call on the same key runs in between.
    """

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

        Both or neither (see ``Claim``). The bucket is judged first: a refused
        charge never looks at the slots.

        Raises:
            ChargeTooLarge: ``amount > capacity``; nothing is touched.
            ValueError: what ``BucketStore.charge`` or ``ConcurrencyStore.acquire``
                reject; nothing is touched.
        """
        ...

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
        """Give ``amount`` tokens back (never above ``capacity``) and free the slot.

        A refund of 0 leaves the bucket as it is; freeing a slot that
        ``request_id`` does not hold is a no-op.
        """
        ...

    async def debit(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> None:
        """Take ``amount`` tokens from ``key``'s bucket whatever its level.

        Down to empty, never refused (``limiter.debit``): tokens a team spent
        while this store was away, owed to it.
        """
        ...


class ConcurrencyStore(Protocol):
    """Count requests in flight per key, with a cap and an expiry per slot."""

    async def acquire(
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
        ...

    async def release(self, key: str, *, request_id: str) -> None:
        """Free the slot of ``request_id`` (a no-op if it holds none)."""
        ...

    async def count(self, key: str, now: float) -> int:
        """Return the number of slots held at ``now`` (unexpired)."""
        ...


class MemoryBucketStore:
    """Keep buckets in this process (the embedded default, without Redis).

    The async face of ``routing.domain.limit_table.BucketTable`` (see there for how
    memory stays bounded). Meant for one event loop: each call runs without
    awaiting, so calls on the same loop never interleave.
    """

    def __init__(self, *, sweep_every: int = 1024) -> None:
        self.table = BucketTable(sweep_every=sweep_every)

    def __len__(self) -> int:
        return len(self.table)

    async def charge(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> Charge:
        """Refill the bucket to ``now`` and take ``amount`` if it holds that much."""
        return self.table.charge(
            key, capacity=capacity, refill_per_s=refill_per_s, amount=amount, now=now
        )

    async def refund(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> None:
        """Give back ``amount`` tokens (never above ``capacity``)."""
        self.table.refund(
            key, capacity=capacity, refill_per_s=refill_per_s, amount=amount, now=now
        )

    def pair(self, slots: ConcurrencyStore) -> MemoryLimits:
        """Return the store that charges here and takes ``slots`` in one step.

        Raises:
            TypeError: ``slots`` is not a ``MemoryConcurrency``.
        """
        if not isinstance(slots, MemoryConcurrency):
            raise TypeError(
                f"memory buckets pair with MemoryConcurrency, not {type(slots).__name__}"
            )
        return MemoryLimits(LimitTable(self.table, slots.table))

    async def peek(
        self, key: str, *, capacity: int, refill_per_s: float, now: float
    ) -> Bucket:
        """Return the bucket as refilled to ``now``, without storing it."""
        return self.table.peek(
            key, capacity=capacity, refill_per_s=refill_per_s, now=now
        )

    def sweep(self, now: float) -> int:
        """Drop the buckets that are full at ``now``; return how many."""
        return self.table.sweep(now)


class MemoryConcurrency:
    """Keep concurrency slots in this process (the embedded default).

    The async face of ``routing.domain.limit_table.SlotTable`` (see there for how
    memory stays bounded). Meant for one event loop, like ``MemoryBucketStore``.
    """

    def __init__(self, *, sweep_every: int = 1024) -> None:
        self.table = SlotTable(sweep_every=sweep_every)

    def __len__(self) -> int:
        return len(self.table)

    async def acquire(
        self,
        key: str,
        *,
        limit: int,
        request_id: str,
        now: float,
        ttl_s: float = 900.0,
    ) -> bool:
        """Take a slot for ``request_id`` unless ``limit`` unexpired slots are held."""
        return self.table.acquire(
            key, limit=limit, request_id=request_id, now=now, ttl_s=ttl_s
        )

    async def release(self, key: str, *, request_id: str) -> None:
        """Free the slot of ``request_id`` (a no-op if it holds none)."""
        self.table.release(key, request_id=request_id)

    async def count(self, key: str, now: float) -> int:
        """Return the number of slots held at ``now`` (unexpired)."""
        return self.table.count(key, now)

    def sweep(self, now: float) -> None:
        """Drop expired slots everywhere, and keys left without slots."""
        self.table.sweep(now)


# -- a bucket charge and a slot together ---------------------------------------------


class MemoryLimits:
    """Charge and take a slot (refund and free it) in one step, in this process.

    The async face of ``routing.domain.limit_table.LimitTable``: each call runs
    without awaiting, so it is atomic on its event loop, and it gives the same
    answers and leaves the same state as ``RedisLimits``.
    """

    def __init__(self, table: LimitTable) -> None:
        self.table = table

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
        """Charge ``amount`` to ``key``'s bucket and take a slot for ``request_id``."""
        return self.table.charge_and_acquire(
            key,
            capacity=capacity,
            refill_per_s=refill_per_s,
            amount=amount,
            limit=limit,
            request_id=request_id,
            now=now,
            ttl_s=ttl_s,
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
        """Give ``amount`` tokens back (never above ``capacity``) and free the slot."""
        self.table.refund_and_release(
            key,
            capacity=capacity,
            refill_per_s=refill_per_s,
            amount=amount,
            request_id=request_id,
            now=now,
        )

    async def debit(
        self, key: str, *, capacity: int, refill_per_s: float, amount: int, now: float
    ) -> None:
        """Take ``amount`` tokens from ``key``'s bucket whatever its level."""
        self.table.debit(
            key, capacity=capacity, refill_per_s=refill_per_s, amount=amount, now=now
        )
