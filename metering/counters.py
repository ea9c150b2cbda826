"""Where the gateway records usage: once per request, at its end, never per token.

Public surface: ``UsageCounter`` (the protocol), ``RedisUsageCounter``,
``MemoryUsageCounter``, ``FailoverUsageCounter``, ``usage_hash_key``,
``usage_index_key``, ``parse_usage_hash_key``, ``check_counts``, ``USAGE_TTL_S``,
``USAGE_KEEP_FLUSHED_S``, ``REDIS_ERRORS``, ``redis_pool``.

With Redis, each (team, model, version, minute) is a hash of running totals under
``<prefix>:usage:<minute_epoch>:<team>:<model>:<version>``, listed in the set
``<prefix>:usage:index`` until the flusher has written it to the database
(``metering.services.flush_redis_usage``). Without Redis (the embedded default),
each gateway process sums in memory and flushes its own ledger. A gateway whose
Redis is unreachable sums in memory too (``FailoverUsageCounter``) and adds the
sums to the same hashes when Redis answers, so the flusher writes every minute's
full totals as if Redis had never been away.

This module is async-side code: it imports no models.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Mapping
from typing import Protocol

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from config.names import is_valid_slug
from metering import metrics
from metering.domain.usage import (
    COUNTER_FIELDS,
    PART_OF,
    UsageCounts,
    UsageKey,
    UsageLedger,
)

logger = logging.getLogger(__name__)

__all__ = [
    "REDIS_ERRORS",
    "USAGE_KEEP_FLUSHED_S",
    "USAGE_TTL_S",
    "AbortingConnection",
    "FailoverUsageCounter",
    "MemoryUsageCounter",
    "RedisUsageCounter",
    "UsageCounter",
    "check_counts",
    "parse_usage_hash_key",
    "redis_pool",
    "usage_hash_key",
    "usage_index_key",
]

# A hash lives this long after its last add, so a flusher that is down cannot grow
# Redis forever (its counts are lost after a week, not before).
USAGE_TTL_S = 7 * 24 * 3600
# A flushed hash is kept this long, so that counts arriving late for its minute
# (clock skew, a slow pipeline) still add to the minute's full totals.
USAGE_KEEP_FLUSHED_S = 3600
# What an unreachable or failing Redis raises (redis-py wraps socket errors in its
# ConnectionError and TimeoutError; OSError covers what it does not wrap).
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, OSError)


class AbortingConnection(redis.asyncio.Connection):
    """A Redis connection whose close discards what Redis has not acknowledged.

    A command sent into a partition (a blackholed Redis) times out, and the
    gateway counts its usage in memory instead (``FailoverUsageCounter``). Closed
    the ordinary way, the socket would keep the unacknowledged command in the
    kernel and retransmit it once the partition heals: Redis would then count it
    too (issue 32's fault suite: 1-2 requests billed twice per outage). With
    SO_LINGER 0 the close is abortive (a reset): the command is dropped, never
    delivered late, so each count lands once.
    """

    async def _connect(self) -> None:
        await super()._connect()
        writer = self._writer
        sock = writer.transport.get_extra_info("socket") if writer else None
        if sock is not None:
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )


def redis_pool(
    url: str, *, max_connections: int, wait_s: float, socket_timeout_s: float
) -> redis.asyncio.BlockingConnectionPool:
    """Return the connection pool of a gateway's Redis client.

    Blocking: a burst of requests ending together waits up to ``wait_s`` for a
    connection instead of failing with "Too many connections".

    A command that finds its pooled connection closed by the server (one opened
    before Redis restarted) is sent once more on a new connection: that command
    never reached the server that answers now, and without the retry each such
    stale connection would fail one call after Redis is back and switch the
    gateway to its local limits again. Timeouts are not retried: a slow command
    may have run, and the hot path must not wait twice.
    """
    return redis.asyncio.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=wait_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        # Plain TCP only: rediss:// and unix:// keep the classes their URL picks.
        **(
            {"connection_class": AbortingConnection}
            if url.startswith("redis://")
            else {}
        ),
    )


class UsageCounter(Protocol):
    """Record the usage of one finished request (called once, in ``finally``)."""

    async def add(self, key: UsageKey, counts: UsageCounts) -> None: ...


def usage_index_key(prefix: str) -> str:
    """Return the key of the set listing the usage hashes not yet flushed."""
    return f"{prefix}:usage:index"


def usage_hash_key(prefix: str, key: UsageKey) -> str:
    """Return the Redis key of a minute's usage hash.

    Raises:
        ValueError: a team, model or version that is not a slug (a ':' would make
            the key ambiguous).
    """
    for name in (key.team, key.model, key.version):
        if not is_valid_slug(name):
            raise ValueError(f"usage key names must be slugs, got {name!r}")
    return f"{prefix}:usage:{key.minute_epoch}:{key.team}:{key.model}:{key.version}"


def parse_usage_hash_key(prefix: str, hash_key: str) -> UsageKey | None:
    """Return the key a usage hash name encodes; None for a malformed name."""
    head = f"{prefix}:usage:"
    if not hash_key.startswith(head):
        return None
    parts = hash_key[len(head) :].split(":")
    if len(parts) != 4 or not parts[0].isdigit():
        return None
    minute, team, model, version = parts
    try:
        key = UsageKey(team, model, version, int(minute))
        canonical = usage_hash_key(prefix, key)
    except ValueError:
        return None
    # "0<epoch>" would parse to the same key as "<epoch>": one key, one name.
    return key if canonical == hash_key else None


def check_counts(counts: UsageCounts) -> None:
    """Raise ValueError for counts no usage row may hold.

    Checked on the way in, so that one bad record cannot make every later flush
    fail on the table's constraints.
    """
    if any(getattr(counts, name) < 0 for name in COUNTER_FIELDS):
        raise ValueError(f"usage counts must not be negative: {counts}")
    for part, whole in PART_OF:
        if getattr(counts, part) > getattr(counts, whole):
            raise ValueError(f"{part} exceed {whole}: {counts}")


class RedisUsageCounter:
    """Add each request's counts to its minute's hash in Redis.

    Counts survive a gateway crash the moment ``add`` returns. Every gateway
    process of a region adds to the same hashes, so a hash holds its minute's full
    totals.
    """

    def __init__(self, client: redis.asyncio.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.index_key = usage_index_key(prefix)
        self._add_script = client.register_script(_ADD_SCRIPT)

    @classmethod
    def from_url(
        cls, url: str, *, prefix: str, max_connections: int = 32, timeout_s: float = 2.0
    ) -> RedisUsageCounter:
        """Connect to ``url`` through a blocking pool.

        Requests finish in bursts; the default pool fails with "Too many
        connections" past its size, a blocking pool makes the burst wait (up to
        ``timeout_s``) for a connection instead.
        """
        pool = redis_pool(
            url,
            max_connections=max_connections,
            wait_s=timeout_s,
            socket_timeout_s=timeout_s,
        )
        return cls(redis.asyncio.Redis.from_pool(pool), prefix)

    async def aclose(self) -> None:
        """Close the client and its connections."""
        await self.client.aclose()

    async def add(self, key: UsageKey, counts: UsageCounts) -> None:
        """Add ``counts`` in one round trip (one Lua script); zero counters are skipped.

        Raises:
            ValueError: a key or counts that no usage row may hold.
            redis.RedisError: Redis is unreachable; the caller decides to drop.
        """
        hash_key = usage_hash_key(self.prefix, key)
        check_counts(counts)
        increments = [
            (name, value) for name in COUNTER_FIELDS if (value := getattr(counts, name))
        ]
        if not increments:
            return
        # One script, so one command and one round trip per request; scripts run
        # atomically, so the flusher never sees a hash half-updated (prompt tokens
        # without their cached part) or a hash missing from the index.
        args: list[str | int] = [USAGE_TTL_S]
        for name, value in increments:
            args += [name, value]
        await self._add_script(keys=[hash_key, self.index_key], args=args)


# KEYS: the minute's hash, the index; ARGV: the TTL, then field/increment pairs.
_ADD_SCRIPT = """
for i = 2, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], KEYS[1])
return 1
"""


class MemoryUsageCounter:
    """Sum counts in this process (the embedded default, without Redis).

    The gateway drains it every flush interval and hands the entries to
    ``metering.services.flush_memory_usage``; counts not yet flushed are lost if
    the process dies.
    """

    def __init__(self) -> None:
        self._ledger = UsageLedger()
        # add() runs on the event loop; drain() may run in a flush thread.
        self._lock = threading.Lock()

    async def add(self, key: UsageKey, counts: UsageCounts) -> None:
        """Add ``counts`` to the ledger (no I/O; the lock is held for a dict update)."""
        check_counts(counts)
        with self._lock:
            self._ledger.add(key, counts)

    def drain(
        self, before_minute_epoch: int | None = None
    ) -> dict[UsageKey, UsageCounts]:
        """Remove and return the sums of minutes before the given one (or all)."""
        with self._lock:
            return self._ledger.drain(before_minute_epoch)

    def restore(self, entries: Mapping[UsageKey, UsageCounts]) -> None:
        """Put drained entries back, e.g. after a flush that failed."""
        with self._lock:
            for key, counts in entries.items():
                self._ledger.add(key, counts)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ledger)


class FailoverUsageCounter:
    """Count in Redis; while Redis is unreachable, in memory until it answers again.

    ``add`` goes to Redis (one round trip, as ``RedisUsageCounter``) until a call
    fails; from then on it sums in memory with no Redis call, and ``restore``
    (called by the gateway once Redis answers its exchange again) adds those sums
    to the minutes' hashes and goes back to Redis. The flusher then writes each
    minute's full totals, so no usage row loses what was counted during the
    outage, provided Redis kept its data (see docs: Redis needs persistence for
    that, with or without an outage). A call whose script ran but whose reply was
    lost is counted again in memory: the only way across an outage to count a
    request twice, never to lose one.
    """

    def __init__(self, shared: RedisUsageCounter) -> None:
        self.shared = shared
        self.is_local = False
        self._buffer = MemoryUsageCounter()

    def __len__(self) -> int:
        """Return the rows waiting in memory for Redis."""
        return len(self._buffer)

    async def add(self, key: UsageKey, counts: UsageCounts) -> None:
        """Add ``counts`` in Redis, or in memory while Redis is unreachable.

        Raises:
            ValueError: a key or counts that no usage row may hold.
        """
        if not self.is_local:
            try:
                await self.shared.add(key, counts)
                return
            except REDIS_ERRORS as exc:
                self.fall_back(exc)
        # What Redis would refuse must not wait in memory and fail every push.
        usage_hash_key(self.shared.prefix, key)
        await self._buffer.add(key, counts)
        metrics.set_usage_buffered(rows=len(self._buffer))

    def fall_back(self, reason: BaseException | None = None) -> None:
        """Count in memory from now on (Redis failed, or is known to be down)."""
        if self.is_local:
            return
        self.is_local = True
        logger.warning(
            "Redis unreachable (%s): usage is counted in memory until it answers",
            type(reason).__name__ if reason is not None else "exchange failed",
        )

    async def restore(self) -> bool:
        """Push the sums counted in memory to Redis, then count there again.

        Return True once back on Redis; False if Redis failed again (what was not
        pushed stays in memory for the next try).
        """
        if not self.is_local:
            return True
        pushed_rows = 0
        # Adds made while the sums are pushed land in memory too: loop until it is
        # empty, then switch with no await in between, so none is left behind.
        while entries := self._buffer.drain():
            pushed: set[UsageKey] = set()
            try:
                for key in sorted(entries, key=_key_order):
                    await self.shared.add(key, entries[key])
                    pushed.add(key)
            except REDIS_ERRORS:
                self._buffer.restore(
                    {k: c for k, c in entries.items() if k not in pushed}
                )
                metrics.set_usage_buffered(rows=len(self._buffer))
                return False
            pushed_rows += len(pushed)
        self.is_local = False
        metrics.set_usage_buffered(rows=0)
        logger.warning(
            "Redis answers again: %d usage rows counted in memory were added there",
            pushed_rows,
        )
        return True

    def drain(self) -> dict[UsageKey, UsageCounts]:
        """Remove and return what waits in memory (at shutdown, Redis still away)."""
        entries = self._buffer.drain()
        metrics.set_usage_buffered(rows=0)
        return entries


def _key_order(key: UsageKey) -> tuple[int, str, str, str]:
    return (key.minute_epoch, key.team, key.model, key.version)
