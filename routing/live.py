"""Live replica load shared by the gateway processes of a region.

Public surface: ``LiveLoad``, ``AttemptLoad``.

Each gateway process knows exactly, and at every instant, the tokens it has in
flight on each replica (prompt plus remaining output of its open requests). Once a
second it publishes that share to Redis and reads the other processes' shares, the
replicas' heartbeats and which gateway processes of the region were seen within the
missed-beat window; a replica's tokens in flight for routing is its own share plus
the others'. Without Redis the gateway is one process, and liveness comes from the
database heartbeats in the snapshot. The share also carries each pool's admitted
tokens and admission queue, which the autoscaler sums over the region's processes
(the layout: ``engine_nodes.domain.load_shares``).

When an exchange fails (Redis unreachable), this process stops trusting what it
last read: the others' shares and the Redis beats are dropped, liveness comes from
the database heartbeats in the snapshot (the node agents write them whatever Redis
does) as without Redis, and ``pool_divisor`` tells admission to take only its part
of each pool (one of the ``gateways_seen`` processes). The next exchange that works
brings it all back. The exchange is also the gateway's probe of Redis
(``routing.failover``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from engine_nodes.domain.beats import (
    ReplicaBeat,
    beat_key,
    decode_beat,
    region_index_key,
)
from engine_nodes.domain.liveness import ReplicaState
from engine_nodes.domain.load_shares import (
    gateway_load_key,
    gateways_seen_key,
    prefill_key,
)
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
        db_beat_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.gateway_id = gateway_id
        self.region = region
        self.redis = redis
        self.prefix = prefix
        self.beat_s = beat_s
        # How often the database hears beats (the snapshot's liveness).
        self.db_beat_s = beat_s if db_beat_s is None else db_beat_s
        self.missed_beats = missed_beats
        self.clock = clock  # unix seconds: when this process was seen, for the others
        self.own: dict[str, int] = {}
        self.others: dict[str, int] = {}
        self.beats: dict[str, ReplicaBeat] = {}
        # True while the last exchange worked (never without Redis).
        self.is_redis_up = redis is not None
        # Gateway processes of the region seen by the last exchange, this one included.
        self.gateways_seen = 1
        # Until this (unix) time after Redis came back, replicas without a Redis beat
        # are judged by their database beat; set by ``exchange``.
        self._settled_at = 0.0
        self._is_settling = False
        self._ejected_until: dict[str, float] = {}
        self._load_key = gateway_load_key(prefix, region, gateway_id)
        # Scored by when each process last exchanged; a new name, not the set
        # "gateways:<region>" that older processes kept.
        self._seen_key = gateways_seen_key(prefix, region)

    @property
    def pool_divisor(self) -> int:
        """Return how many ways this process splits a pool's capacity.

        1 while it sees the region's load through Redis (or runs alone, without
        Redis); while Redis is unreachable, the gateway processes last seen, since
        each of them then admits on its own.
        """
        if self.redis is None or self.is_redis_up:
            return 1
        return self.gateways_seen

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

    def put(self, key: str, value: int) -> None:
        """Set a figure of this process's share (a pool's queue); 0 removes it."""
        if value > 0:
            self.own[key] = value
        else:
            self.own.pop(key, None)

    def tokens_in_flight(self, replica_id: str) -> int:
        """Return the replica's tokens in flight over every gateway process."""
        return self.own.get(replica_id, 0) + self.others.get(replica_id, 0)

    def prefill_tokens_in_flight(self, replica_id: str) -> int:
        """Return the prompt tokens the replica still owes in prefill, over every
        gateway process (requests routed to it without a first token yet, less
        what its cache was predicted to hold)."""
        key = prefill_key(replica_id)
        return self.own.get(key, 0) + self.others.get(key, 0)

    def eject(self, replica_id: str, now: float) -> None:
        """Keep a replica that just failed out of this process's choices for a while.

        Its heartbeats take up to the missed-beat window to stop; without this, every
        request in between would try it first and spend the retry budget.
        """
        self._ejected_until[replica_id] = now + self._window_s()

    def _window_s(self) -> float:
        """Return the missed-beat window of the beats routing trusts now."""
        beat_s = self.beat_s if self.is_redis_up else self.db_beat_s
        return beat_s * self.missed_beats

    # -- eligibility ----------------------------------------------------------------------

    def nodes(
        self, snapshot: ConfigSnapshot, model: str, version: str, now: float
    ) -> list[NodeSnapshot]:
        """Return the replicas of ``model@version`` that may take a request now."""
        ejected = self._ejected_until
        # Redis beats while the exchange reads them; else the database's, as
        # without Redis (the node agents write those whether Redis answers or not).
        # Just after Redis returns, a replica not yet heard there is judged by its
        # database beat (see ``_is_settling``).
        use_beats = self.is_redis_up
        window_s = self.db_beat_s * self.missed_beats
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
            beat = self.beats.get(replica.replica_id) if use_beats else None
            if beat is not None:
                if beat.state != ReplicaState.SERVING:
                    continue
                queue_depth, kv = beat.queue_depth, beat.kv_cache_usage_perc
            else:
                if use_beats and not self._is_settling:
                    continue  # silent in Redis
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
                    prefill_tokens_in_flight=self.prefill_tokens_in_flight(
                        replica.replica_id
                    ),
                )
            )
        return nodes

    # -- the once-a-second exchange through Redis -------------------------------------------

    async def exchange(self) -> None:
        """Publish this process's share; read the others', the beats, the gateways.

        Raises:
            Exception: what Redis raised; this process then judges liveness by the
                database beats and splits pools (``pool_divisor``) until an
                exchange works again.
        """
        if self.redis is None:
            return
        now = self.clock()
        try:
            gateways = await self._exchange(now)
        except Exception:
            self._lose_sight()
            raise
        if not self.is_redis_up:
            # Redis is back, maybe restarted empty or with the beats expired while
            # it was away: the agents' next beats reach it within a beat. Until a
            # missed-beat window has passed, the database's beats vouch for the
            # replicas not heard there yet, so none looks silent meanwhile.
            self._settled_at = now + self.beat_s * self.missed_beats
        self._is_settling = now < self._settled_at
        # The other processes list themselves again within that window too: until
        # then, count no fewer than before the outage (the share of a next one).
        self.gateways_seen = (
            max(gateways, self.gateways_seen) if self._is_settling else gateways
        )
        self.is_redis_up = True

    def _lose_sight(self) -> None:
        """Forget what Redis told: stale shares and beats would mislead routing."""
        self.is_redis_up = False
        self.others = {}
        self.beats = {}

    async def _exchange(self, now: float) -> int:
        """Do one exchange; return how many gateway processes were seen."""
        assert self.redis is not None
        window_s = self.beat_s * self.missed_beats
        ttl_ms = max(1, round(window_s * 1000))
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self._load_key)
        if self.own:
            pipe.hset(self._load_key, mapping={k: str(v) for k, v in self.own.items()})
            pipe.pexpire(self._load_key, ttl_ms)
        # Every process is listed while it exchanges, idle or not, so that
        # ``gateways_seen`` counts the processes that could admit a team's requests.
        pipe.zadd(self._seen_key, {self.gateway_id: now})
        pipe.zremrangebyscore(self._seen_key, "-inf", now - window_s)
        pipe.pexpire(self._seen_key, ttl_ms)
        pipe.zrange(self._seen_key, 0, -1)
        pipe.smembers(region_index_key(self.prefix, self.region))
        results = await pipe.execute()
        gateway_ids = sorted(_text(g) for g in results[-2])
        replica_ids = sorted(_text(r) for r in results[-1])
        pipe = self.redis.pipeline(transaction=False)
        others = [g for g in gateway_ids if g != self.gateway_id]
        for gateway_id in others:
            pipe.hgetall(gateway_load_key(self.prefix, self.region, gateway_id))
        for replica_id in replica_ids:
            pipe.hgetall(beat_key(self.prefix, replica_id))
        results = await pipe.execute()
        totals: dict[str, int] = {}
        for raw in results[: len(others)]:
            for replica_id, tokens in raw.items():
                key = _text(replica_id)
                totals[key] = totals.get(key, 0) + int(tokens)
        beats = {}
        for replica_id, raw in zip(replica_ids, results[len(others) :], strict=True):
            beat = decode_beat(raw) if raw else None
            if beat is not None:
                beats[replica_id] = beat
        self.others = totals
        self.beats = beats
        return len(others) + 1

    async def leave(self) -> None:
        """Remove this process's share at shutdown."""
        if self.redis is None:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self._load_key)
        pipe.zrem(self._seen_key, self.gateway_id)
        await pipe.execute()


class AttemptLoad:
    """One attempt's tokens in flight on its replica, lowered as its output arrives.

    Counted into ``live`` when built (prompt plus ``max_tokens``, the most it can
    hold), lowered by ``shrink`` as output tokens stream (never below the prompt,
    which stays in the replica's KV cache until the answer ends), and taken off
    entirely by ``drop``. ``prefill`` (the prompt tokens the replica is expected to
    compute) counts as owed prefill until ``prefilled`` (its first token) or
    ``drop``.
    """

    __slots__ = ("floor", "live", "prefill", "replica_id", "tokens")

    def __init__(
        self,
        live: LiveLoad,
        replica_id: str,
        *,
        tokens: int,
        floor: int,
        prefill: int = 0,
    ) -> None:
        self.live = live
        self.replica_id = replica_id
        self.floor = floor
        self.tokens = tokens
        self.prefill = max(prefill, 0)
        live.add(replica_id, tokens)
        if self.prefill:
            live.add(prefill_key(replica_id), self.prefill)

    def prefilled(self) -> None:
        """The first token came: the prompt is computed."""
        if self.prefill:
            self.live.remove(prefill_key(self.replica_id), self.prefill)
            self.prefill = 0

    def shrink(self, output_tokens: int) -> None:
        """Count ``output_tokens`` more as generated."""
        left = max(self.floor, self.tokens - output_tokens)
        self.live.remove(self.replica_id, self.tokens - left)
        self.tokens = left

    def drop(self) -> None:
        """The attempt ended: take all its tokens off the replica."""
        self.live.remove(self.replica_id, self.tokens)
        self.tokens = 0
        self.prefilled()


def _db_alive(replica: ReplicaRecord, wall_now: float, window_s: float) -> bool:
    return (
        replica.state == ReplicaState.SERVING
        and replica.last_heartbeat_at is not None
        and wall_now - replica.last_heartbeat_at <= window_s
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
