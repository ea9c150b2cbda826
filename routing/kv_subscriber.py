"""The gateway's ears on its replicas' prefix caches: one ZMQ subscription per
replica that publishes KV events, feeding one ``PrefixIndex`` per pool.

Public surface: ``KVEventSubscriber``.

``sync(snapshot)`` (once a second, with the live-load exchange) opens a SUB socket
to every replica of the region whose record names a ``kv_events_url``, closes the
ones whose replica left, and drops those replicas from their pool's index. Each
socket has a reader task that decodes batches and applies them to the index: off
the request path, which only calls ``cached_tokens`` (a hash per prompt block and
a dict lookup per block).

A replica's entries are dropped whenever what it holds becomes unknown:

- its connection drops (the socket's monitor reports a disconnect: the engine
  died or restarted, and a restarted engine's cache starts empty);
- a batch is lost (a gap in the sequence numbers) or the numbering starts again
  (``PrefixIndex.apply``);
- it leaves the snapshot.

Frames that are not KV event batches are counted and skipped, never raised: one
bad publisher cannot stop the others' updates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from metering import metrics
from routing.domain.kv_index import PrefixIndex, prompt_block_keys
from routing.domain.snapshot import ConfigSnapshot
from simengine.domain.kv_events import KVEventError, unpack_frames

__all__ = ["KVEventSubscriber"]

logger = logging.getLogger(__name__)

Pool = tuple[str, str]


@dataclass(slots=True)
class _Subscription:
    pool: Pool
    url: str
    socket: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    reader: asyncio.Task[None]
    watcher: asyncio.Task[None]


class KVEventSubscriber:
    """Subscriptions to the region's replicas' KV events, and the pools' indexes."""

    def __init__(
        self,
        *,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._context = context
        self.clock = clock
        self.indexes: dict[Pool, PrefixIndex] = {}
        self._subscriptions: dict[str, _Subscription] = {}
        self.batches = 0  # applied
        self.rejected = 0  # frames that were not batches

    # -- the request path ---------------------------------------------------------------

    def cached_tokens(
        self, model: str, version: str, prompt_ids: Sequence[int], prompt_tokens: int
    ) -> dict[str, int] | None:
        """Return each replica's cached leading tokens of a prompt; None when the
        pool has no index yet (no replica of it publishes, or none has published)
        or the prompt's token ids are unknown."""
        index = self.indexes.get((model, version))
        if index is None or index.block_size is None or not prompt_ids:
            return None
        return index.match(
            prompt_block_keys(prompt_ids, index.block_size), prompt_tokens
        )

    # -- keeping up with the snapshot ---------------------------------------------------

    def sync(self, snapshot: ConfigSnapshot | None) -> None:
        """Subscribe to new publishers, drop those that left."""
        if snapshot is None:
            return
        wanted: dict[str, tuple[Pool, str]] = {
            replica.replica_id: (
                (replica.model, replica.version),
                replica.kv_events_url,
            )
            for replica in snapshot.replicas
            if replica.kv_events_url
        }
        for replica_id, subscription in list(self._subscriptions.items()):
            if wanted.get(replica_id) != (subscription.pool, subscription.url):
                self._close(replica_id)
        for replica_id, (pool, url) in wanted.items():
            if replica_id not in self._subscriptions:
                self._open(replica_id, pool, url)
        for pool, index in list(self.indexes.items()):
            members = {rid for rid, (p, _url) in wanted.items() if p == pool}
            index.retain(members)
            if not members:
                del self.indexes[pool]

    async def close(self) -> None:
        """Close every subscription (the gateway stopping)."""
        tasks = []
        for replica_id in list(self._subscriptions):
            tasks.extend(self._close(replica_id))
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._context is not None:
            self._context.term()
            self._context = None

    # -- internals ----------------------------------------------------------------------

    def _open(self, replica_id: str, pool: Pool, url: str) -> None:
        if self._context is None:
            self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            socket.connect(url)
        except zmq.ZMQError as exc:
            logger.warning(
                "replica %s: cannot subscribe to %s: %s", replica_id, url, exc
            )
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)
            return
        self.indexes.setdefault(pool, PrefixIndex())
        self._subscriptions[replica_id] = _Subscription(
            pool=pool,
            url=url,
            socket=socket,
            monitor=monitor,
            reader=asyncio.create_task(self._read(replica_id, pool, socket)),
            watcher=asyncio.create_task(self._watch(replica_id, pool, monitor)),
        )

    def _close(self, replica_id: str) -> list[asyncio.Task[None]]:
        subscription = self._subscriptions.pop(replica_id, None)
        if subscription is None:
            return []
        index = self.indexes.get(subscription.pool)
        if index is not None:
            index.forget(replica_id)
        subscription.reader.cancel()
        subscription.watcher.cancel()
        with contextlib.suppress(zmq.ZMQError):
            subscription.socket.disable_monitor()
        subscription.monitor.close(linger=0)
        subscription.socket.close(linger=0)
        return [subscription.reader, subscription.watcher]

    async def _read(
        self, replica_id: str, pool: Pool, socket: zmq.asyncio.Socket
    ) -> None:
        while True:
            frames = await socket.recv_multipart()
            try:
                _topic, seq, batch = unpack_frames(frames)
            except KVEventError as exc:
                self.rejected += 1
                metrics.count_kv_batch("rejected")
                if self.rejected == 1 or self.rejected % 1000 == 0:
                    logger.warning(
                        "replica %s: skipped a KV event frame (%d so far): %s",
                        replica_id,
                        self.rejected,
                        exc,
                    )
                continue
            index = self.indexes.get(pool)
            if index is None:
                continue
            cleared = index.cleared
            index.apply(replica_id, seq, batch, self.clock())
            self.batches += 1
            if index.cleared != cleared:
                metrics.count_kv_batch("cleared")
            metrics.count_kv_batch("applied")

    async def _watch(
        self, replica_id: str, pool: Pool, monitor: zmq.asyncio.Socket
    ) -> None:
        while True:
            message = parse_monitor_message(await monitor.recv_multipart())
            if message["event"] == zmq.EVENT_DISCONNECTED:
                index = self.indexes.get(pool)
                if index is not None:
                    index.forget(replica_id)
