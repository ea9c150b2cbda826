"""Where the gateway records usage: once per request, at its end, never per token.

Public surface: ``UsageCounter`` (the protocol), ``RedisUsageCounter``,
``MemoryUsageCounter``, ``usage_hash_key``, ``usage_index_key``,
``parse_usage_hash_key``, ``check_counts``, ``USAGE_TTL_S``, ``USAGE_KEEP_FLUSHED_S``.

With Redis, each (team, model, version, minute) is a hash of running totals under
``<prefix>:usage:<minute_epoch>:<team>:<model>:<version>``, listed in the set
``<prefix>:usage:index`` until the flusher has written it to the database
(``metering.services.flush_redis_usage``). Without Redis (the embedded default),
each gateway process sums in memory and flushes its own ledger.

This module is async-side code: it imports no models.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Protocol

import redis.asyncio

from accounts.domain.names import is_valid_slug
from metering.domain.usage import COUNTER_FIELDS, UsageCounts, UsageKey, UsageLedger

__all__ = [
    "USAGE_KEEP_FLUSHED_S",
    "USAGE_TTL_S",
    "MemoryUsageCounter",
    "RedisUsageCounter",
    "UsageCounter",
    "check_counts",
    "parse_usage_hash_key",
    "usage_hash_key",
    "usage_index_key",
]

# A hash lives this long after its last add, so a flusher that is down cannot grow
# Redis forever (its counts are lost after a week, not before).
USAGE_TTL_S = 7 * 24 * 3600
# A flushed hash is kept this long, so that counts arriving late for its minute
# (clock skew, a slow pipeline) still add to the minute's full totals.
USAGE_KEEP_FLUSHED_S = 3600


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
    if counts.cached_tokens > counts.prompt_tokens:
        raise ValueError(f"cached_tokens exceed prompt_tokens: {counts}")


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
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
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
