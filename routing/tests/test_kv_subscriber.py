"""The gateway's KV-event subscriptions, against real ZMQ publishers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from routing.domain.snapshot import ConfigSnapshot, ReplicaRecord
from routing.kv_subscriber import KVEventSubscriber
from simengine.domain.kv_events import BlockStored, EventBatch, pack_frames

BS = 16
PROMPT = list(range(1000, 1050))  # 50 tokens: 3 full blocks


def snapshot(**urls: str) -> ConfigSnapshot:
    return ConfigSnapshot(
        region="r",
        built_at=time.time(),
        replicas=tuple(
            ReplicaRecord(
                replica_id=rid, model="m", version="v", region="r", url="http://x",
                state="serving", queue_depth=0, tokens_in_flight=0,
                kv_cache_usage_perc=0.0, last_heartbeat_at=time.time(),
                kv_events_url=url,
            )
            for rid, url in urls.items()
        ),
    )  # fmt: skip


def stored_batch() -> EventBatch:
    event = BlockStored(
        block_hashes=(11, 12, 13),
        parent_block_hash=None,
        token_ids=tuple(PROMPT[: 3 * BS]),
        block_size=BS,
    )
    return EventBatch(ts=time.time(), events=(event,))


async def until(
    condition: Callable[[], bool], tick: Callable[[], Awaitable[None]], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await tick()


def test_events_feed_the_index_and_a_lost_publisher_empties_it() -> None:
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        pub = context.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        subscriber = KVEventSubscriber()
        subscriber.sync(snapshot(a=f"tcp://127.0.0.1:{port}"))
        seq = 0

        async def publish() -> None:
            # A new subscription misses what was sent before it joined: send
            # until it is heard (the same blocks each time, numbered on).
            nonlocal seq
            await pub.send_multipart(pack_frames("kv@a@m", seq, stored_batch()))
            seq += 1
            await asyncio.sleep(0.01)

        def cached() -> dict[str, int] | None:
            return subscriber.cached_tokens("m", "v", PROMPT, len(PROMPT))

        await until(lambda: cached() == {"a": 3 * BS}, publish, 10)
        # A frame that is no batch is skipped, and counted.
        await pub.send_multipart([b"kv@a@m", b"\x00" * 8, b"\xc1junk"])
        await until(lambda: subscriber.rejected == 1, publish, 10)
        assert cached() == {"a": 3 * BS}
        # The publisher goes away (the engine died or restarted): its entries go.
        pub.close(linger=0)
        await until(lambda: cached() in (None, {}), lambda: asyncio.sleep(0.01), 10)
        await subscriber.close()
        context.term()

    asyncio.run(scenario())


def test_a_replica_that_leaves_the_snapshot_is_unsubscribed() -> None:
    async def scenario() -> None:
        subscriber = KVEventSubscriber()
        subscriber.sync(snapshot(a="tcp://127.0.0.1:9", b="tcp://127.0.0.1:10"))
        assert set(subscriber._subscriptions) == {"a", "b"}
        subscriber.sync(snapshot(b="tcp://127.0.0.1:10"))
        assert set(subscriber._subscriptions) == {"b"}
        # A replica whose URL changed is subscribed again at the new one.
        subscriber.sync(snapshot(b="tcp://127.0.0.1:11"))
        assert subscriber._subscriptions["b"].url == "tcp://127.0.0.1:11"
        subscriber.sync(snapshot())
        assert subscriber.indexes == {}
        await subscriber.close()

    asyncio.run(scenario())


def test_no_index_means_no_prediction() -> None:
    subscriber = KVEventSubscriber()
    assert subscriber.cached_tokens("m", "v", PROMPT, len(PROMPT)) is None
