"""Where the gateway records the rollout guards' figures: once per request, at its end.

Public surface: ``FigureKey``, ``FigureRecorder`` (the protocol),
``RedisFigureRecorder``, ``MemoryFigureRecorder``, ``figures_hash_key``,
``figures_index_key``, ``figures_conversations_key``, ``parse_figures_hash_key``,
``FIGURES_TTL_S``, ``FIGURES_KEEP_FLUSHED_S``.

With Redis, each (bucket, role, model, version) is a hash of running totals
(``VersionFigures.to_fields()``) under
``<prefix>:figures:<bucket_s>:<bucket_epoch>:<role>:<model>:<version>``, listed in
the set ``<prefix>:figures:index``; the conversations it saw go into a HyperLogLog
beside it (``<hash>:conv``), so that every gateway process of a region counts
into one distinct count. The flusher (``metering.services.flush_redis_figures``,
with usage) writes each listed hash's full totals to its row and forgets buckets
a couple of buckets old. Without Redis (the embedded default) each gateway process
sums in memory and its own flush adds the sums to the rows.

Figures are not billing: a request whose figures Redis cannot take loses them
(counted in ``platform_figures_dropped_total``, one warning per outage), and the
request never notices. While Redis fails, adds are dropped without a call for a
second, so an outage costs no timeout per request.

This module is async-side code: it imports no models.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import redis.asyncio

from config.names import is_valid_slug
from metering import metrics
from metering.counters import REDIS_ERRORS
from metering.domain.figures import Role, VersionFigures

logger = logging.getLogger(__name__)

__all__ = [
    "FIGURES_KEEP_FLUSHED_S",
    "FIGURES_TTL_S",
    "FigureKey",
    "FigureRecorder",
    "MemoryFigureRecorder",
    "RedisFigureRecorder",
    "figures_conversations_key",
    "figures_hash_key",
    "figures_index_key",
    "parse_figures_hash_key",
]

# A bucket's hash lives this long after its last add: a flusher down for a day
# loses the figures of that day, never Redis's memory.
FIGURES_TTL_S = 24 * 3600
# A bucket forgotten by the flusher is kept this long, so that figures arriving
# late for it still add to its full totals (and list it again).
FIGURES_KEEP_FLUSHED_S = 3600
_ROLES = frozenset(role.value for role in Role)
# After a failed add, adds are dropped without a call to Redis for this long.
_RETRY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class FigureKey:
    """One bucket of one version's figures in one role.

    ``bucket_epoch`` is the bucket's start in unix seconds, a multiple of
    ``bucket_s``; ``bucket_s`` is part of the key so that a flusher never reads
    a bucket with a length it does not know.
    """

    model: str
    version: str
    role: str
    bucket_epoch: int
    bucket_s: int = 60

    @classmethod
    def from_time(
        cls, model: str, version: str, role: str, at: float, bucket_s: int
    ) -> FigureKey:
        """Return the key of the bucket holding unix time ``at``."""
        return cls(model, version, role, math.floor(at / bucket_s) * bucket_s, bucket_s)

    @property
    def bucket_start(self) -> datetime:
        """The bucket's start as an aware UTC datetime."""
        return datetime.fromtimestamp(self.bucket_epoch, tz=UTC)

    @property
    def bucket_end_epoch(self) -> int:
        return self.bucket_epoch + self.bucket_s

    def check(self) -> None:
        """Raise ValueError for a key no hash name or row may hold.

        Model and version must be slugs (a ':' would make the name ambiguous), the
        role one of ``Role``, the bucket a non-negative multiple of a positive
        length.
        """
        for name in (self.model, self.version):
            if not is_valid_slug(name):
                raise ValueError(f"figure key names must be slugs, got {name!r}")
        if self.role not in _ROLES:
            raise ValueError(f"unknown figures role {self.role!r}")
        if (
            self.bucket_s <= 0
            or self.bucket_epoch < 0
            or self.bucket_epoch % self.bucket_s
        ):
            raise ValueError(
                f"bucket {self.bucket_epoch} is not a multiple of {self.bucket_s} s"
            )


class FigureRecorder(Protocol):
    """Record the figures of one finished request (called once, in ``finally``)."""

    async def add(
        self, key: FigureKey, figures: VersionFigures, conversation: str | None
    ) -> None: ...


def figures_index_key(prefix: str) -> str:
    """Return the key of the set listing the figures hashes the flusher writes."""
    return f"{prefix}:figures:index"


def figures_hash_key(prefix: str, key: FigureKey) -> str:
    """Return the Redis key of a bucket's figures hash.

    Raises:
        ValueError: a key that ``FigureKey.check`` refuses.
    """
    key.check()
    return (
        f"{prefix}:figures:{key.bucket_s}:{key.bucket_epoch}:{key.role}:"
        f"{key.model}:{key.version}"
    )


def figures_conversations_key(hash_key: str) -> str:
    """Return the key of the HyperLogLog of a figures hash's conversations."""
    return f"{hash_key}:conv"


def parse_figures_hash_key(prefix: str, hash_key: str) -> FigureKey | None:
    """Return the key a figures hash name encodes; None for a malformed name."""
    head = f"{prefix}:figures:"
    if not hash_key.startswith(head):
        return None
    parts = hash_key[len(head) :].split(":")
    if len(parts) != 5 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    bucket_s, bucket_epoch, role, model, version = parts
    try:
        key = FigureKey(model, version, role, int(bucket_epoch), int(bucket_s))
        canonical = figures_hash_key(prefix, key)
    except ValueError:
        return None
    # "060" would parse to the same key as "60": one key, one name.
    return key if canonical == hash_key else None


# KEYS: the bucket's hash, the index, the HyperLogLog. ARGV: the TTL, the
# conversation ('' for none), then field/increment pairs.
_ADD_SCRIPT = """
for i = 3, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], KEYS[1])
if ARGV[2] ~= '' then
  redis.call('PFADD', KEYS[3], ARGV[2])
  redis.call('EXPIRE', KEYS[3], ARGV[1])
end
return 1
"""


class RedisFigureRecorder:
    """Add each request's figures to its bucket's hash in Redis, or drop them.

    Every gateway process of a region adds to the same hashes, so a hash holds
    its bucket's figures over all of them. ``add`` never raises.
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        prefix: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.index_key = figures_index_key(prefix)
        self._add_script = client.register_script(_ADD_SCRIPT)
        self._clock = clock
        self._failing_since: float | None = None
        self._retry_at = 0.0

    async def add(
        self, key: FigureKey, figures: VersionFigures, conversation: str | None
    ) -> None:
        """Add ``figures`` (and the conversation) in one round trip (one script).

        A key that no hash may hold, or a Redis that fails, drops the figures:
        counted, logged once per outage, never raised.
        """
        try:
            hash_key = figures_hash_key(self.prefix, key)
        except ValueError as exc:
            metrics.count_figures_dropped(reason="invalid")
            logger.warning("dropping figures of an invalid key: %s", exc)
            return
        fields = figures.to_fields()
        if not fields and not conversation:
            return
        if self._failing_since is not None and self._clock() < self._retry_at:
            metrics.count_figures_dropped(reason="redis")
            return
        args: list[str | int] = [FIGURES_TTL_S, conversation or ""]
        for name, value in fields.items():
            args += [name, value]
        try:
            # One script: one round trip, and the flusher never sees a hash
            # half-updated or missing from the index.
            await self._add_script(
                keys=[hash_key, self.index_key, figures_conversations_key(hash_key)],
                args=args,
            )
        except REDIS_ERRORS as exc:
            metrics.count_figures_dropped(reason="redis")
            now = self._clock()
            self._retry_at = now + _RETRY_AFTER_S
            if self._failing_since is None:
                self._failing_since = now
                logger.warning(
                    "Redis unreachable (%s): rollout figures are dropped until it "
                    "answers",
                    type(exc).__name__,
                )
            return
        if self._failing_since is not None:
            logger.warning(
                "Redis answers again: rollout figures are recorded after %.1f s "
                "dropped",
                self._clock() - self._failing_since,
            )
            self._failing_since = None

    async def aclose(self) -> None:
        """Close the client and its connections."""
        await self.client.aclose()


class MemoryFigureRecorder:
    """Sum figures in this process (the embedded default, without Redis).

    The gateway drains it with its usage flush and hands the sums to
    ``metering.services.flush_memory_figures``, which adds them to the rows.
    Conversations are counted distinct per bucket: the keys seen are kept until
    the bucket has ended, and a drain reports only those not reported before, so
    a bucket drained several times still counts each conversation once. Sums not
    yet flushed are lost if the process dies.
    """

    def __init__(self) -> None:
        self._sums: dict[FigureKey, VersionFigures] = {}
        self._new_conversations: dict[FigureKey, int] = {}
        self._seen: dict[FigureKey, set[str]] = {}
        # add() runs on the event loop; drain() may run in a flush thread.
        self._lock = threading.Lock()

    async def add(
        self, key: FigureKey, figures: VersionFigures, conversation: str | None
    ) -> None:
        """Add ``figures`` to the bucket's sums (no I/O); an invalid key is dropped."""
        try:
            key.check()
        except ValueError as exc:
            metrics.count_figures_dropped(reason="invalid")
            logger.warning("dropping figures of an invalid key: %s", exc)
            return
        with self._lock:
            current = self._sums.get(key)
            self._sums[key] = figures if current is None else current + figures
            if conversation:
                seen = self._seen.setdefault(key, set())
                if conversation not in seen:
                    seen.add(conversation)
                    self._new_conversations[key] = (
                        self._new_conversations.get(key, 0) + 1
                    )

    def drain(self, now: float | None = None) -> dict[FigureKey, VersionFigures]:
        """Remove and return the sums so far, conversations new since the last drain.

        The conversations seen in buckets that ended before unix time ``now`` are
        forgotten (no later add can name them); without ``now``, all are.
        """
        with self._lock:
            sums, self._sums = self._sums, {}
            new, self._new_conversations = self._new_conversations, {}
            for key in list(self._seen):
                if now is None or key.bucket_end_epoch <= now:
                    del self._seen[key]
        drained: dict[FigureKey, VersionFigures] = {}
        for key in sums.keys() | new.keys():
            figures = sums.get(key, VersionFigures())
            drained[key] = figures + VersionFigures(conversations=new.get(key, 0))
        return drained

    def restore(self, entries: dict[FigureKey, VersionFigures]) -> None:
        """Put drained sums back (a flush that failed), conversations included."""
        with self._lock:
            for key, figures in entries.items():
                current = self._sums.get(key)
                self._sums[key] = figures if current is None else current + figures

    def __len__(self) -> int:
        with self._lock:
            return len(self._sums.keys() | self._new_conversations.keys())
