"""Live replica load shared by the gateway processes of a region.

Public surface: ``LiveLoad``, ``AttemptLoad``.

Each gateway process knows exactly, and at every instant, the tokens it has in
flight on each replica (prompt plus remaining output of its open requests). Once a
second it publishes that share to Redis and reads the other processes' shares and
the replicas' heartbeats; a replica's tokens in flight for routing is its own share
plus the others'. Without Redis the gateway is one process, and liveness comes from
the database heartbeats in the snapshot.
"""

from __future__ import annotations

import logging
from typing import Any

from engine_nodes.domain.beats import (
    ReplicaBeat,
    beat_key,
    decode_beat,
    region_index_key,
)
from engine_nodes.domain.liveness import ReplicaState
from routing.domain.snapshot import ConfigSnapshot, NodeSnapshot, ReplicaRecord

logger = logging.getLogger(__name__)


class LiveLoad:
    """Tokens in flight per replica (all gateways), liveness, and local ejections."""

    def __init__(
        self,
        *,
        gateway_id: str,
        region: str,
        redis: Any | None,
        prefix: str,
        beat_s: float,
        missed_beats: int,
    ) -> None:
        self.gateway_id = gateway_id
        self.region = region
        self.redis = redis
        self.prefix = prefix
        self.beat_s = beat_s
        self.missed_beats = missed_beats
        self.own: dict[str, int] = {}
        self.others: dict[str, int] = {}
        self.beats: dict[str, ReplicaBeat] = {}
        self._ejected_until: dict[str, float] = {}
        self._load_key = f"{prefix}:load:{region}:{gateway_id}"
        self._gateways_key = f"{prefix}:gateways:{region}"

    # -- this process's share (hot path: plain dict arithmetic) ---------------------------

    def add(self, replica_id: str, tokens: int) -> None:
        """Count ``tokens`` more in flight on a replica."""
        self.own[replica_id] = self.own.get(replica_id, 0) + tokens

    def remove(self, replica_id: str, tokens: int) -> None:
        """Count ``tokens`` fewer in flight on a replica (never below zero)."""
        left = self.own.get(replica_id, 0) - tokens
        if left > 0:
            self.own[replica_id] = left
        else:
            self.own.pop(replica_id, None)

    def tokens_in_flight(self, replica_id: str) -> int:
        """Return the replica's tokens in flight over every gateway process."""
        return self.own.get(replica_id, 0) + self.others.get(replica_id, 0)

    def eject(self, replica_id: str, now: float) -> None:
        """Keep a replica that just failed out of this process's choices for a while.

        Its heartbeats take up to the missed-beat window to stop; without this, every
        request in between would try it first and spend the retry budget.
        """
        self._ejected_until[replica_id] = now + self.beat_s * self.missed_beats

    # -- eligibility ----------------------------------------------------------------------

    def nodes(
        self, snapshot: ConfigSnapshot, model: str, version: str, now: float
    ) -> list[NodeSnapshot]:
        """Return the replicas of ``model@version`` that may take a request now."""
        ejected = self._ejected_until
        use_beats = self.redis is not None
        window_s = self.beat_s * self.missed_beats
        # Database beats are judged as of the snapshot that carries them: when the
        # database is unreachable, the replicas alive in the last snapshot keep
        # serving instead of all looking silent.
        as_of = snapshot.built_at
        nodes = []
        for replica in snapshot.replicas:
            if replica.model != model or replica.version != version:
                continue
            until = ejected.get(replica.replica_id)
            if until is not None:
                if until > now:
                    continue
                del ejected[replica.replica_id]
            if use_beats:
                beat = self.beats.get(replica.replica_id)
                if beat is None or beat.state != ReplicaState.SERVING:
                    continue
                queue_depth, kv = beat.queue_depth, beat.kv_cache_usage_perc
            else:
                if not _db_alive(replica, as_of, window_s):
                    continue
                queue_depth, kv = replica.queue_depth, replica.kv_cache_usage_perc
            nodes.append(
                NodeSnapshot(
                    replica_id=replica.replica_id,
                    url=replica.url,
                    tokens_in_flight=self.tokens_in_flight(replica.replica_id),
                    queue_depth=queue_depth,
                    kv_cache_usage_perc=kv,
                )
            )
        return nodes

    # -- the once-a-second exchange through Redis -------------------------------------------

    async def exchange(self) -> None:
        """Publish this process's share; read the others' and the replicas' beats."""
        if self.redis is None:
            return
        ttl_ms = max(1, round(self.beat_s * self.missed_beats * 1000))
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self._load_key)
        if self.own:
            pipe.hset(self._load_key, mapping={k: str(v) for k, v in self.own.items()})
            pipe.pexpire(self._load_key, ttl_ms)
        pipe.sadd(self._gateways_key, self.gateway_id)
        pipe.smembers(self._gateways_key)
        pipe.smembers(region_index_key(self.prefix, self.region))
        results = await pipe.execute()
        gateway_ids = sorted(_text(g) for g in results[-2])
        replica_ids = sorted(_text(r) for r in results[-1])
        pipe = self.redis.pipeline(transaction=False)
        others = [g for g in gateway_ids if g != self.gateway_id]
        for gateway_id in others:
            pipe.hgetall(f"{self.prefix}:load:{self.region}:{gateway_id}")
        for replica_id in replica_ids:
            pipe.hgetall(beat_key(self.prefix, replica_id))
        results = await pipe.execute()
        totals: dict[str, int] = {}
        gone = []
        for gateway_id, raw in zip(others, results[: len(others)], strict=True):
            if not raw:
                gone.append(gateway_id)  # its share expired: that process is gone
            for replica_id, tokens in raw.items():
                key = _text(replica_id)
                totals[key] = totals.get(key, 0) + int(tokens)
        self.others = totals
        if gone:
            await self.redis.srem(self._gateways_key, *gone)
        beats = {}
        for replica_id, raw in zip(replica_ids, results[len(others) :], strict=True):
            beat = decode_beat(raw) if raw else None
            if beat is not None:
                beats[replica_id] = beat
        self.beats = beats

    async def leave(self) -> None:
        """Remove this process's share at shutdown."""
        if self.redis is None:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self._load_key)
        pipe.srem(self._gateways_key, self.gateway_id)
        await pipe.execute()


class AttemptLoad:
    """One attempt's tokens in flight on its replica, lowered as its output arrives.

    Counted into ``live`` when built (prompt plus ``max_tokens``, the most it can
    hold), lowered by ``shrink`` as output tokens stream (never below the prompt,
    which stays in the replica's KV cache until the answer ends), and taken off
    entirely by ``drop``.
    """

    __slots__ = ("floor", "live", "replica_id", "tokens")

    def __init__(
        self, live: LiveLoad, replica_id: str, *, tokens: int, floor: int
    ) -> None:
        self.live = live
        self.replica_id = replica_id
        self.floor = floor
        self.tokens = tokens
        live.add(replica_id, tokens)

    def shrink(self, output_tokens: int) -> None:
        """Count ``output_tokens`` more as generated."""
        left = max(self.floor, self.tokens - output_tokens)
        self.live.remove(self.replica_id, self.tokens - left)
        self.tokens = left

    def drop(self) -> None:
        """The attempt ended: take all its tokens off the replica."""
        self.live.remove(self.replica_id, self.tokens)
        self.tokens = 0


def _db_alive(replica: ReplicaRecord, wall_now: float, window_s: float) -> bool:
    return (
        replica.state == ReplicaState.SERVING
        and replica.last_heartbeat_at is not None
        and wall_now - replica.last_heartbeat_at <= window_s
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
