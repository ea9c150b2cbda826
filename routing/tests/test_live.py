"""Live load shared through Redis, and which replicas may take a request."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as redis_asyncio

from engine_nodes.domain.beats import ReplicaBeat
from engine_nodes.heartbeats import RedisBeatStore
from routing.domain.snapshot import ConfigSnapshot, ReplicaRecord
from routing.live import AttemptLoad, LiveLoad


def replica(
    replica_id: str,
    *,
    state: str = "serving",
    beat_at: float | None = 100.0,
    version: str = "v1",
) -> ReplicaRecord:
    return ReplicaRecord(
        replica_id=replica_id,
        model="chat-7b",
        version=version,
        region="r",
        url=f"http://{replica_id}",
        state=state,
        queue_depth=0,
        tokens_in_flight=0,
        kv_cache_usage_perc=0.0,
        last_heartbeat_at=beat_at,
    )


def snapshot(*replicas: ReplicaRecord, built_at: float = 101.0) -> ConfigSnapshot:
    return ConfigSnapshot(built_at=built_at, region="r", replicas=tuple(replicas))


def test_own_share_adds_and_removes() -> None:
    live = LiveLoad(
        gateway_id="g", region="r", redis=None, prefix="p", beat_s=1.0, missed_beats=3
    )
    live.add("a", 1500)
    live.add("a", 500)
    live.remove("a", 1500)
    assert live.tokens_in_flight("a") == 500
    live.remove("a", 900)
    assert live.tokens_in_flight("a") == 0
    assert "a" not in live.own


def test_an_attempt_owes_its_prefill_until_its_first_token() -> None:
    live = LiveLoad(
        gateway_id="g", region="r", redis=None, prefix="p", beat_s=1.0, missed_beats=3
    )
    first = AttemptLoad(live, "a", tokens=2300, floor=2000, prefill=1500)
    second = AttemptLoad(live, "a", tokens=600, floor=500, prefill=500)
    assert live.prefill_tokens_in_flight("a") == 2000
    assert live.tokens_in_flight("a") == 2900
    nodes = live.nodes(snapshot(replica("a")), "chat-7b", "v1", now=0.0)
    assert [n.prefill_tokens_in_flight for n in nodes] == [2000]
    first.prefilled()
    first.prefilled()  # once only
    assert live.prefill_tokens_in_flight("a") == 500
    # Ended before its first token (failed over, or the client left).
    second.drop()
    first.drop()
    assert live.prefill_tokens_in_flight("a") == 0
    assert live.tokens_in_flight("a") == 0


def test_database_liveness_is_judged_as_of_the_snapshot() -> None:
    live = LiveLoad(
        gateway_id="g", region="r", redis=None, prefix="p", beat_s=1.0, missed_beats=3
    )
    snap = snapshot(
        replica("fresh", beat_at=100.0),
        replica("stale", beat_at=97.0),
        replica("loading", state="loading"),
        replica("never", beat_at=None),
        replica("other", version="v2"),
    )
    assert [n.replica_id for n in live.nodes(snap, "chat-7b", "v1", now=0.0)] == [
        "fresh"
    ]


def test_ejected_replica_returns_after_the_missed_beat_window() -> None:
    live = LiveLoad(
        gateway_id="g", region="r", redis=None, prefix="p", beat_s=1.0, missed_beats=3
    )
    snap = snapshot(replica("a"), replica("b"))
    live.eject("a", now=10.0)
    assert [n.replica_id for n in live.nodes(snap, "chat-7b", "v1", now=12.9)] == ["b"]
    assert len(live.nodes(snap, "chat-7b", "v1", now=13.1)) == 2


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    value = f"test-live-{uuid.uuid4().hex[:8]}"
    yield value
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{value}:*"):
        client.delete(key)


def test_gateways_share_tokens_in_flight_and_read_beats(
    redis_url: str, prefix: str
) -> None:
    store = RedisBeatStore(redis.Redis.from_url(redis_url), prefix=prefix, ttl_s=3.0)
    store.publish(
        [
            ReplicaBeat(
                replica_id=rid,
                model="chat-7b",
                version="v1",
                region="r",
                node="n",
                url=f"http://{rid}",
                state=state,
                queue_depth=2,
                num_running=1,
                tokens_in_flight=0,
                kv_cache_usage_perc=0.1,
                beat_at=time.time(),
            )
            for rid, state in (("a", "serving"), ("b", "draining"))
        ]
    )

    async def scenario() -> tuple[int, int, list[str]]:
        clients = [redis_asyncio.Redis.from_url(redis_url) for _ in range(2)]
        one, two = (
            LiveLoad(
                gateway_id=name,
                region="r",
                redis=client,
                prefix=prefix,
                beat_s=1.0,
                missed_beats=3,
            )
            for name, client in zip(("g1", "g2"), clients, strict=True)
        )
        one.add("a", 1000)
        two.add("a", 300)
        for live in (one, two, one, two):
            await live.exchange()
        nodes = one.nodes(
            snapshot(replica("a"), replica("b"), replica("c")), "chat-7b", "v1", now=0.0
        )
        await one.leave()
        await two.exchange()
        for client in clients:
            await client.aclose()
        return (
            one.tokens_in_flight("a"),
            two.tokens_in_flight("a"),
            [n.replica_id for n in nodes],
        )

    seen_by_one, seen_by_two_after_leave, eligible = asyncio.run(scenario())
    assert seen_by_one == 1300
    # Only serving replicas with a live beat: b drains, c never beat.
    assert eligible == ["a"]
    assert seen_by_two_after_leave == 300
