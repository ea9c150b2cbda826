"""Replica heartbeats in Redis, for the routers and the autoscaler.

The node agent publishes one beat per replica per second; each beat expires after
the missed-beat window, so a dead replica vanishes from Redis without anyone
cleaning up. The database gets the same figures through ``record_heartbeats``.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis
from redis.typing import EncodableT, FieldT

from engine_nodes.domain.beats import (
    ReplicaBeat,
    beat_key,
    decode_beat,
    encode_beat,
    region_index_key,
)


class RedisBeatStore:
    """Publish and read replica beats under a key prefix."""

    def __init__(self, client: redis.Redis, *, prefix: str, ttl_s: float) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_ms = max(1, round(ttl_s * 1000))

    @classmethod
    def from_url(cls, url: str, *, prefix: str, ttl_s: float) -> RedisBeatStore:
        """Connect to ``url`` (short timeouts: a beat must never block the agent)."""
        client = redis.Redis.from_url(
            url, socket_timeout=0.5, socket_connect_timeout=0.5
        )
        return cls(client, prefix=prefix, ttl_s=ttl_s)

    def publish(self, beats: Iterable[ReplicaBeat]) -> int:
        """Write beats in one round trip; return how many were written."""
        pipe = self.client.pipeline(transaction=False)
        count = 0
        for beat in beats:
            key = beat_key(self.prefix, beat.replica_id)
            # Mapping's key type is invariant: re-key str -> FieldT for hset.
            fields: dict[FieldT, EncodableT] = dict(encode_beat(beat).items())
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, self.ttl_ms)
            pipe.sadd(region_index_key(self.prefix, beat.region), beat.replica_id)
            count += 1
        if count:
            pipe.execute()
        return count

    def forget(self, replica_id: str, region: str) -> None:
        """Remove a replica's beat at once (it was stopped on purpose)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(beat_key(self.prefix, replica_id))
        pipe.srem(region_index_key(self.prefix, region), replica_id)
        pipe.execute()

    def read_region(self, region: str) -> list[ReplicaBeat]:
        """Return the live beats of a region, pruning ids whose beat expired."""
        index = region_index_key(self.prefix, region)
        ids = sorted(
            m.decode() if isinstance(m, bytes) else m
            for m in self.client.smembers(index)
        )
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for replica_id in ids:
            pipe.hgetall(beat_key(self.prefix, replica_id))
        beats = []
        expired = []
        for replica_id, raw in zip(ids, pipe.execute(), strict=True):
            beat = decode_beat(raw) if raw else None
            if beat is None:
                expired.append(replica_id)
            else:
                beats.append(beat)
        if expired:
            self.client.srem(index, *expired)
        return beats
