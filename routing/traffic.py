"""The traffic twin's recorder: sampled requests, kept without text, off the hot path.

Public surface: ``TrafficRecorder``, ``TrafficStore``, ``RedisTrafficStore``,
``read_traffic``, ``traffic_salt``, ``stream_key``.

``TrafficRecorder.offer`` is called once per request, after it is metered. For a
pool that does not record (``VersionRecord.traffic_share`` 0) it returns after a
dictionary look-up; for one that does, and a conversation in its share
(``routing.domain.traffic.is_sampled``), it keeps the request's numbers and
token ids in a bounded list (``buffer_max``: past it, records are dropped and
counted) and, if none is due, schedules a flush ``flush_s`` later. The flush,
a background task, hashes the prompts' blocks and writes the batch in one
pipeline: the answer never waits for either.

``RedisTrafficStore`` keeps one stream per model (``<prefix>:traffic:<model>``)
in the region's Redis, one entry per batch (its records as JSON rows: an entry
per record cost the gateway ten times the CPU, in redis-py's command packing):
each batch trims entries older than ``retention_s`` and caps the stream at about
``max_records`` records; the key expires ``retention_s`` after
its last write. ``read_traffic`` reads a window of it back (``export_traffic``).
Without Redis (the embedded platform) nothing is recorded: the gateway logs so at
start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from metering import metrics
from routing.attempt import AttemptResult
from routing.background import BackgroundTasks
from routing.domain.snapshot import ConfigSnapshot
from routing.domain.traffic import (
    TrafficRecord,
    block_chain,
    derive_salt,
    is_sampled,
    salted_id,
)
from routing.plan import ChatPlan

logger = logging.getLogger(__name__)

# The version of a stream entry's layout: {"format", "records": JSON rows}.
ENTRY_FORMAT = "1"

__all__ = [
    "RedisTrafficStore",
    "TrafficRecorder",
    "TrafficStore",
    "read_traffic",
    "stream_key",
    "traffic_salt",
]


def traffic_salt() -> bytes:
    """Return the hashing key from settings: PLATFORM_TRAFFIC_SALT, else derived
    from SECRET_KEY."""
    from django.conf import settings

    return derive_salt(settings.PLATFORM_TRAFFIC_SALT or settings.SECRET_KEY)


def stream_key(prefix: str, model: str) -> str:
    """Return the Redis stream of ``model``'s records."""
    return f"{prefix}:traffic:{model}"


class TrafficStore(Protocol):
    """Where recorded requests go."""

    async def append(self, records: Sequence[TrafficRecord]) -> None:
        """Keep ``records`` (one batch)."""
        ...


class RedisTrafficStore:
    """Records in a Redis stream per model, trimmed by age and by count."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        *,
        retention_s: float,
        max_records: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.retention_s = retention_s
        self.max_records = max_records
        self.clock = clock

    async def append(self, records: Sequence[TrafficRecord]) -> None:
        """Add ``records`` as one entry per model, then drop what is past the
        retention, in one round trip."""
        oldest_ms = int((self.clock() - self.retention_s) * 1000)
        rows: dict[str, list[list[Any]]] = {}
        for record in records:
            rows.setdefault(record.model, []).append(record.to_row())
        async with self.client.pipeline(transaction=False) as pipe:
            for model, batch in sorted(rows.items()):
                key = stream_key(self.prefix, model)
                pipe.xadd(
                    key,
                    {
                        "format": ENTRY_FORMAT,
                        "records": json.dumps(batch, separators=(",", ":")),
                    },
                    # The cap counts entries: about max_records at this batch size.
                    maxlen=max(1, self.max_records // len(batch)),
                    approximate=True,
                )
                pipe.xtrim(key, minid=oldest_ms, approximate=False)
                pipe.pexpire(key, int(self.retention_s * 1000))
            await pipe.execute()


@dataclasses.dataclass(frozen=True, slots=True)
class _Pending:
    """A sampled request before its flush: its record less the hashes."""

    record: TrafficRecord
    routing_key: str
    prompt_ids: tuple[int, ...]


class TrafficRecorder:
    """Record the sampled requests of the pools that opt in (one per gateway)."""

    def __init__(
        self,
        *,
        store: TrafficStore,
        background: BackgroundTasks,
        salt: bytes,
        block_size: int,
        flush_s: float,
        buffer_max: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.background = background
        self.salt = salt
        self.block_size = block_size
        self.flush_s = flush_s
        self.buffer_max = buffer_max
        self.clock = clock
        self.dropped = 0
        self.written = 0
        self._pending: list[_Pending] = []
        self._is_due = False

    def offer(
        self, plan: ChatPlan, snapshot: ConfigSnapshot, ended: AttemptResult
    ) -> None:
        """Keep ``plan``'s request if its pool records it and its conversation is
        in the pool's share; never raises, never waits."""
        resolution = plan.resolution
        version = snapshot.versions.get((resolution.model, resolution.version))
        if version is None or version.traffic_share <= 0.0:
            return
        if plan.surface == "embeddings" or not is_sampled(
            plan.routing_key, version.traffic_share
        ):
            return
        if len(self._pending) >= self.buffer_max:
            self.dropped += 1
            metrics.TRAFFIC_RECORDS.labels(resolution.model, "dropped").inc()
            return
        usage = ended.usage
        record = TrafficRecord(
            at=self.clock() - (time.monotonic() - plan.started_at),
            team=plan.team,
            tier=plan.tier.value,
            model=resolution.model,
            version=resolution.version,
            surface=plan.surface,
            prompt_tokens=usage.prompt_tokens if usage else plan.prompt_tokens,
            max_tokens=plan.max_tokens,
            output_tokens=usage.completion_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            key="",
            replica=ended.replica_id or "",
            outcome=ended.outcome,
            block_size=self.block_size,
            blocks=(),
        )
        self._pending.append(_Pending(record, plan.routing_key, plan.prompt_ids))
        if not self._is_due:
            self._is_due = True
            self.background.spawn(self._flush_later())

    async def _flush_later(self) -> None:
        try:
            await asyncio.sleep(self.flush_s)
        finally:
            self._is_due = False
        await self.flush()

    async def flush(self) -> None:
        """Hash the waiting requests' prompts and write them in one batch; a batch
        the store refuses is dropped (counted and logged), never retried into
        the hot path."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        records = [
            dataclasses.replace(
                item.record,
                key=salted_id(item.routing_key, self.salt),
                blocks=tuple(
                    block_chain(
                        item.prompt_ids, block_size=self.block_size, salt=self.salt
                    )
                ),
            )
            for item in pending
        ]
        try:
            await self.store.append(records)
        except Exception as exc:
            self.dropped += len(records)
            _count(records, "dropped")
            logger.warning(
                "traffic records dropped (%d): %s", len(records), type(exc).__name__
            )
            return
        self.written += len(records)
        _count(records, "written")


def _count(records: Sequence[TrafficRecord], outcome: str) -> None:
    by_model: dict[str, int] = {}
    for record in records:
        by_model[record.model] = by_model.get(record.model, 0) + 1
    for model, n in by_model.items():
        metrics.TRAFFIC_RECORDS.labels(model, outcome).inc(n)


def read_traffic(
    client: Any,
    *,
    prefix: str,
    model: str,
    since: float,
    until: float,
    page: int = 1000,
    lag_s: float = 3600.0,
) -> Iterator[TrafficRecord]:
    """Yield ``model``'s records that arrived in [since, until) (unix seconds),
    read from a synchronous Redis client.

    Entries are written after their request ends, so the stream is read from
    ``since`` to ``lag_s`` past ``until`` and filtered on arrival.
    """
    key = stream_key(prefix, model)
    start: str = str(int(since * 1000))
    end = str(int((until + lag_s) * 1000))
    while True:
        entries = client.xrange(key, min=start, max=end, count=page)
        for entry_id, fields in entries:
            for record in _entry_records(entry_id, fields):
                if since <= record.at < until:
                    yield record
        if len(entries) < page:
            return
        last = entries[-1][0]
        start = "(" + (last.decode() if isinstance(last, bytes) else last)


def _entry_records(entry_id: object, fields: Mapping[Any, Any]) -> list[TrafficRecord]:
    """Return the records of one stream entry; none (logged) if it is malformed."""
    decoded = {
        (k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()
    }
    try:
        if decoded.get("format") not in (ENTRY_FORMAT, ENTRY_FORMAT.encode()):
            raise ValueError("unknown format")
        return [TrafficRecord.from_row(row) for row in json.loads(decoded["records"])]
    except (KeyError, TypeError, ValueError):
        logger.warning("traffic entry %r is malformed: skipped", entry_id)
        return []
