"""Conversation versions in real Redis (``routing.sticky``): shared by every gateway
process, refreshed per turn, and harmless when Redis is away."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
import redis.asyncio

from routing.domain.sticky import Remembered
from routing.sticky import (
    MemoryConversationVersions,
    RedisConversationVersions,
    sticky_key,
)


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(coroutine)


@pytest.fixture
def prefix() -> str:
    return f"t-sticky-{uuid.uuid4().hex[:8]}"


def test_two_gateways_share_a_conversation_s_version(
    redis_url: str, prefix: str
) -> None:
    async def scenario() -> list[Remembered | None]:
        one = redis.asyncio.Redis.from_url(redis_url)
        two = redis.asyncio.Redis.from_url(redis_url)
        try:
            a = RedisConversationVersions(one, prefix, ttl_s=60)
            b = RedisConversationVersions(two, prefix, ttl_s=60)
            base = await a.choose(
                "chat-7b", "conv:b", Remembered("v1", baseline=True), ["v1", "v2"]
            )
            # A baseline conversation keeps its version and its band.
            kept = await b.choose("chat-7b", "conv:b", Remembered("v2"), ["v1", "v2"])
            assert base == kept == Remembered("v1", baseline=True)
            first = await a.choose("chat-7b", "conv:x", Remembered("v2"), ["v1", "v2"])
            # Another process, another split choice: the remembered one wins.
            again = await b.choose(
                "chat-7b", "conv:x", Remembered("v1", baseline=True), ["v1", "v2"]
            )
            # The canary is gone (rolled back): the conversation starts again.
            back = await b.choose("chat-7b", "conv:x", Remembered("v1"), ["v1"])
            return [first, again, back]
        finally:
            await one.aclose()
            await two.aclose()

    first, again, back = run(scenario())
    assert first == again == Remembered("v2")
    assert back == Remembered("v1")
    client = redis.Redis.from_url(redis_url)
    key = sticky_key(prefix, "chat-7b", "conv:x")
    assert client.get(key) == b"v1|o"
    assert 0 < client.ttl(key) <= 60
    client.delete(key)


def test_an_unreachable_redis_leaves_the_split_s_choice(prefix: str) -> None:
    async def scenario() -> Remembered | None:
        client = redis.asyncio.Redis(
            host="127.0.0.1", port=1, socket_connect_timeout=0.2
        )
        try:
            store = RedisConversationVersions(client, prefix)
            return await store.choose(
                "chat-7b", "conv:y", Remembered("v2"), ["v1", "v2"]
            )
        finally:
            await client.aclose()

    # Nothing remembered: the split's own choice stands (stick moves nothing).
    assert run(scenario()) is None


def test_the_memory_store_is_bounded_and_forgets_the_oldest() -> None:
    store = MemoryConversationVersions(max_entries=2)

    async def scenario() -> list[Remembered | None]:
        seen: list[Remembered | None] = []
        for key in ("a", "b", "c"):
            seen.append(await store.choose("m", key, Remembered("v2"), ["v1", "v2"]))
        # "a" was forgotten: it takes what it is offered now.
        seen.append(await store.choose("m", "a", Remembered("v1"), ["v1", "v2"]))
        seen.append(await store.choose("m", "c", Remembered("v1"), ["v1", "v2"]))
        return seen

    assert run(scenario()) == [Remembered("v2")] * 3 + [
        Remembered("v1"),
        Remembered("v2"),
    ]
