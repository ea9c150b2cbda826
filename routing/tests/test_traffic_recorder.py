"""The traffic twin's recorder: sampled requests go to Redis off the hot path,
without text, trimmed by age; pools that do not record write nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

import pytest
from prometheus_client import REGISTRY

from routing.attempt import AttemptResult
from routing.background import BackgroundTasks
from routing.domain.resolve import Resolution
from routing.domain.snapshot import ConfigSnapshot, LimitRecord, VersionRecord
from routing.domain.tiers import Tier
from routing.domain.traffic import TrafficRecord, block_chain, derive_salt, salted_id
from routing.plan import ChatPlan
from routing.responses import FinalUsage
from routing.traffic import RedisTrafficStore, TrafficRecorder, read_traffic, stream_key
from simengine.domain import tokens

SALT = derive_salt("test secret")
PROMPT = "The quarterly numbers of Project Nightingale are confidential."
LIMIT = LimitRecord("alpha", "chat-7b", 10_000, 4, 0.25)


def snapshot(**shares: float) -> ConfigSnapshot:
    return ConfigSnapshot(
        built_at=0.0,
        region="eu",
        versions={
            ("chat-7b", label): VersionRecord(
                "chat-7b", label, "ready", 8192, None, traffic_share=share
            )
            for label, share in shares.items()
        },
    )


def plan(version: str, conversation: str) -> ChatPlan:
    ids = tokens.encode(tokens.render_chat([{"role": "user", "content": PROMPT}]))
    return ChatPlan(
        request_id="chatcmpl-1",
        team="alpha",
        model_ref="chat-7b",
        resolution=Resolution("chat-7b", version, False, False, None),
        tier=Tier.INTERACTIVE,
        limit=LIMIT,
        prompt_tokens=len(ids),
        max_tokens=40,
        stream=True,
        routing_key="conv:" + conversation,
        payload=b'{"messages": "' + PROMPT.encode() + b'"}',
        # A request that began just now (``started_at`` is monotonic time): the
        # record's arrival is the recorder's clock less the time since.
        started_at=time.monotonic(),
        prompt_ids=tuple(ids),
    )


ENDED = AttemptResult(
    "ok",
    "replica-1",
    usage=FinalUsage(prompt_tokens=20, cached_tokens=16, completion_tokens=7),
)


class ListStore:
    def __init__(self) -> None:
        self.batches: list[list[TrafficRecord]] = []

    async def append(self, records: list[TrafficRecord]) -> None:
        self.batches.append(list(records))


def recorder(store: object, background: BackgroundTasks, **kw: int) -> TrafficRecorder:
    return TrafficRecorder(
        store=store,  # type: ignore[arg-type]
        background=background,
        salt=SALT,
        block_size=4,
        flush_s=0.01,
        buffer_max=kw.get("buffer_max", 100),
        clock=lambda: 5000.0,
    )


def test_requests_are_kept_then_written_in_one_batch_with_their_hashes() -> None:
    store = ListStore()

    async def run() -> None:
        background = BackgroundTasks()
        traffic = recorder(store, background)
        for n in range(3):
            traffic.offer(plan("v1", f"c{n}"), snapshot(v1=1.0), ENDED)
        assert store.batches == []  # nothing written on the request's path
        await background.drain()

    asyncio.run(run())
    [batch] = store.batches
    first = batch[0]
    assert first.key == salted_id("conv:c0", SALT)
    assert first.blocks == tuple(
        block_chain(plan("v1", "c0").prompt_ids, block_size=4, salt=SALT)
    )
    assert (first.team, first.tier, first.version, first.replica) == (
        "alpha",
        "interactive",
        "v1",
        "replica-1",
    )
    assert (first.prompt_tokens, first.cached_tokens, first.output_tokens) == (
        20,
        16,
        7,
    )
    assert first.max_tokens == 40 and first.at < 5000.0


def test_a_pool_that_does_not_record_keeps_nothing_and_the_buffer_is_bounded() -> None:
    store = ListStore()

    async def run() -> TrafficRecorder:
        background = BackgroundTasks()
        traffic = recorder(store, background, buffer_max=2)
        traffic.offer(plan("v0", "c"), snapshot(v0=0.0), ENDED)
        traffic.offer(plan("v9", "c"), snapshot(v1=1.0), ENDED)  # unknown version
        for n in range(3):
            traffic.offer(plan("v1", f"c{n}"), snapshot(v1=1.0), ENDED)
        await background.drain()
        return traffic

    traffic = asyncio.run(run())
    assert [len(batch) for batch in store.batches] == [2]
    assert traffic.dropped == 1


class RefusingStore:
    async def append(self, records: list[TrafficRecord]) -> None:
        raise ConnectionError("redis is down")


def test_written_and_dropped_records_are_counted_for_prometheus() -> None:
    def count(outcome: str) -> float:
        value = REGISTRY.get_sample_value(
            "platform_traffic_records_total",
            {"model": "chat-7b", "outcome": outcome},
        )
        return value or 0.0

    written, dropped = count("written"), count("dropped")

    async def run(store: object, buffer_max: int) -> None:
        background = BackgroundTasks()
        traffic = recorder(store, background, buffer_max=buffer_max)
        for n in range(3):
            traffic.offer(plan("v1", f"c{n}"), snapshot(v1=1.0), ENDED)
        await background.drain()

    asyncio.run(run(ListStore(), buffer_max=2))  # 2 written, 1 over the buffer
    assert (count("written") - written, count("dropped") - dropped) == (2, 1)
    asyncio.run(run(RefusingStore(), buffer_max=10))  # Redis refuses all 3
    assert (count("written") - written, count("dropped") - dropped) == (2, 4)


def test_records_in_redis_hold_no_text_and_age_out(redis_url: str) -> None:
    import redis
    import redis.asyncio as redis_asyncio

    prefix = f"test-{uuid.uuid4().hex[:8]}"

    async def write(n: int) -> None:
        client = redis_asyncio.Redis.from_url(redis_url)
        store = RedisTrafficStore(
            client, prefix, retention_s=60.0, max_records=1000, clock=lambda: 5000.0
        )
        background = BackgroundTasks()
        traffic = recorder(store, background)
        for i in range(n):
            traffic.offer(plan("v1", f"c{i}"), snapshot(v1=1.0), ENDED)
        await background.drain()
        await client.aclose()

    with redis.Redis.from_url(redis_url) as client:
        key = stream_key(prefix, "chat-7b")
        try:
            # An entry written at 1 s (stream ids are milliseconds), past the
            # retention of a write at 5000 s.
            client.xadd(key, {"at": "1"}, id="1000-0")
            asyncio.run(write(2))
            raw = b"".join(
                b"".join(k + v for k, v in fields.items())
                for _, fields in client.xrange(key)
            )
            assert b"Nightingale" not in raw and b"conv:" not in raw
            assert b"1000-0" not in [entry_id for entry_id, _ in client.xrange(key)]
            assert 0 < client.pttl(key) <= 60_000
            records = list(
                read_traffic(
                    client, prefix=prefix, model="chat-7b", since=0.0, until=1e10
                )
            )
            assert len(records) == 2
        finally:
            client.delete(key)


@pytest.mark.parametrize("page", [1, 2, 1000])
def test_reading_a_window_pages_through_the_stream(redis_url: str, page: int) -> None:
    import redis

    prefix = f"test-{uuid.uuid4().hex[:8]}"
    key = stream_key(prefix, "chat-7b")
    base = TrafficRecord(
        at=0.0,
        team="t",
        tier="standard",
        model="chat-7b",
        version="v1",
        surface="chat",
        prompt_tokens=5,
        max_tokens=5,
        output_tokens=5,
        cached_tokens=0,
        key="k",
        replica="r",
        outcome="ok",
        block_size=16,
        blocks=(),
    )
    with redis.Redis.from_url(redis_url) as client:
        try:
            for second in (100, 200, 250, 300, 400):
                rows = [dataclasses.replace(base, at=second).to_row()]
                fields = {"format": "1", "records": json.dumps(rows)}
                if second == 250:
                    fields = {"format": "1", "records": "[[1]]"}  # malformed: skipped
                client.xadd(key, fields, id=f"{second * 1000 + 500}-0")
            got = read_traffic(
                client, prefix=prefix, model="chat-7b", since=200, until=400, page=page
            )
            assert [r.at for r in got] == [200.0, 300.0]
        finally:
            client.delete(key)
