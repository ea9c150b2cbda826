"""A replica that stalls, end to end: two simulated replicas, one stalled.

Real gateway, agent and replica processes, Redis and the openai SDK. The stall is
the simulated replica's fault (``POST /sim/faults``): its engine stops stepping
while ``/health`` stays 200, as a hung GPU does. Short timeouts keep the tests
short; what they check holds for any.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
import redis
import redis.asyncio

from accounts.models import TeamLimit
from engine_nodes.models import Replica
from localrun.processes import wait_until
from routing.limiter_redis import RedisBucketStore, RedisConcurrency
from tests.live import LivePlatform, extra_of, start_platform, usage_of

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FIRST_TOKEN_TIMEOUT_S = 3.0
INTER_TOKEN_TIMEOUT_S = 2.0
STALL_AFTER_S = 2.0
# Timers fire late on a loaded machine, never early; this much late is allowed.
LATE_S = 3.0
# Team beta's bucket: small enough that a charge left behind shows at once
# (100 tokens a second refill), two streams at most.
BETA_TOKENS_PER_MINUTE = 6000
BETA_MAX_CONCURRENCY = 2
MAX_TOKENS = 3000
LIMIT_KEY = "beta:chat-7b"


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("stall")
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            pools={"v1": 2},
            PLATFORM_FIRST_TOKEN_TIMEOUT_S=str(FIRST_TOKEN_TIMEOUT_S),
            PLATFORM_INTER_TOKEN_TIMEOUT_S=str(INTER_TOKEN_TIMEOUT_S),
            PLATFORM_STALL_AFTER_S=str(STALL_AFTER_S),
        ) as live,
    ):
        TeamLimit.objects.filter(team_id="beta").update(
            tokens_per_minute=BETA_TOKENS_PER_MINUTE,
            max_concurrency=BETA_MAX_CONCURRENCY,
        )
        wait_until(
            lambda: (
                ask(live, "beta", max_tokens=1).headers["x-ratelimit-limit-tokens"]
                == str(BETA_TOKENS_PER_MINUTE)
            ),
            timeout_s=20,
            message="the gateway to see beta's new limits",
        )
        yield live


def ask(platform: LivePlatform, team: str, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{platform.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {platform.keys[team]}"},
        json={
            "model": "chat-7b",
            "messages": [{"role": "user", "content": "hello"}],
            **body,
        },
        timeout=30,
    )


def set_faults(platform: LivePlatform, replica_url: str, **faults: object) -> None:
    token = platform.env.get("PLATFORM_SIM_ADMIN_TOKEN")
    httpx.post(
        f"{replica_url}/sim/faults",
        json=faults,
        headers={"Authorization": f"Bearer {token}"} if token else {},
    ).raise_for_status()


def owner_and_other(platform: LivePlatform, conversation: str) -> tuple[str, str]:
    """Return the URLs of the replica that owns ``conversation`` and of the other."""
    answer = platform.client().chat.completions.create(
        model="chat-7b",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=1,
        extra_headers={"x-conversation-id": conversation},
    )
    owner = extra_of(answer)["replica_id"]
    urls = {r.replica_id: r.url for r in platform.serving()}
    assert len(urls) == 2 and owner in urls
    (other,) = set(urls) - {owner}
    return urls[owner], urls[other]


@dataclass(frozen=True)
class Limits:
    """Team beta's bucket level (as stored) and slots held, read from Redis."""

    tokens: float
    slots: int


def read_limits(redis_url: str, prefix: str) -> Limits:
    async def read() -> Limits:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            raw = await client.hgetall(
                RedisBucketStore(client, prefix).bucket_key(LIMIT_KEY)
            )
            slots = await RedisConcurrency(client, prefix).count(LIMIT_KEY, time.time())
            return Limits(tokens=float(raw[b"tokens"]), slots=slots)
        finally:
            await client.aclose()

    return asyncio.run(read())


def usage_counted(redis_url: str, prefix: str) -> tuple[int, int]:
    """Return beta's (requests, output tokens) counted in Redis, not yet flushed."""
    client = redis.Redis.from_url(redis_url)
    requests = output = 0
    for key in client.scan_iter(f"{prefix}:usage:*:beta:chat-7b:*"):
        requests += int(client.hget(key, "requests") or 0)
        output += int(client.hget(key, "output_tokens") or 0)
    client.close()
    return requests, output


def assert_released(
    redis_url: str, platform: LivePlatform, *, remaining: int, refund: int
) -> None:
    """The slot is free and the unused part of the charge is back in the bucket.

    ``remaining`` is what the answer's headers said was left after its charge;
    the bucket only refills on top, so at least ``remaining + refund`` (at most
    the capacity) must be stored once the answer has ended.
    """

    def freed() -> Limits | None:
        limits = read_limits(redis_url, platform.prefix)
        return limits if limits.slots == 0 else None

    released = wait_until(freed, timeout_s=10, message="beta's slot to be released")
    assert released.tokens >= min(BETA_TOKENS_PER_MINUTE, remaining + refund) - 1


def test_a_stalled_replica_before_the_first_token_is_retried_invisibly(
    platform: LivePlatform, redis_url: str, unblocked: None
) -> None:
    """GIVEN two replicas, and the one that owns a conversation stalled (idle, so
    nothing on its /metrics shows it)
    WHEN that conversation streams
    THEN the client's stream is served by the other replica with no error, its
    first byte after the first-token timeout; then the slot is free, the unused
    charge is back and the usage is counted; once the stall ends the conversation
    returns to its replica.
    """
    stalled_url, other_url = owner_and_other(platform, "stall-before")
    set_faults(platform, stalled_url, stall=True)
    try:
        before = usage_counted(redis_url, platform.prefix)
        started = time.monotonic()
        raw = platform.client(
            "beta", timeout=FIRST_TOKEN_TIMEOUT_S * 4
        ).chat.completions.with_raw_response.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_headers={"x-conversation-id": "stall-before"},
        )
        first_byte_s = time.monotonic() - started
        chunks = list(raw.parse())
        final = chunks[-1]
        completion = usage_of(final).completion_tokens
        served_by = extra_of(final)["replica_id"]
        assert raw.headers["x-replica-id"] == served_by
        assert served_by in {r.replica_id for r in platform.serving()}
        assert other_url == Replica.objects.get(replica_id=served_by).url
        assert completion == sum(
            1 for c in chunks if c.choices and c.choices[0].delta.content
        )
        # The first attempt waited out the first-token deadline, unseen.
        assert FIRST_TOKEN_TIMEOUT_S <= first_byte_s < FIRST_TOKEN_TIMEOUT_S + LATE_S
        assert_released(
            redis_url,
            platform,
            remaining=int(raw.headers["x-ratelimit-remaining-tokens"]),
            refund=MAX_TOKENS - completion,
        )
        wait_until(
            lambda: (
                usage_counted(redis_url, platform.prefix)
                == (before[0] + 1, before[1] + completion)
            ),
            timeout_s=10,
            message="the usage to be counted once",
        )
    finally:
        set_faults(platform, stalled_url, stall=False)
    # Back on its replica once the gateway's ejection of it has run out.
    returns_to(platform, "stall-before", stalled_url)


def returns_to(platform: LivePlatform, conversation: str, url: str) -> None:
    def served_by() -> str:
        answer = platform.client("beta").chat.completions.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=1,
            extra_headers={"x-conversation-id": conversation},
        )
        return str(extra_of(answer)["replica_id"])

    replica_id = Replica.objects.get(url=url).replica_id
    wait_until(
        lambda: served_by() == replica_id,
        timeout_s=15,
        message=f"{conversation} to return to its replica",
    )


def test_a_stall_mid_stream_ends_with_the_error_event_and_releases_everything(
    platform: LivePlatform, redis_url: str, unblocked: None
) -> None:
    """GIVEN a stream under way on a replica
    WHEN that replica's engine stalls
    THEN the client gets the stream's error event after the inter-token timeout;
    the slot is free, the unused charge back and the tokens sent are counted; the
    agent marks the replica stalled, the gateway sends that conversation to the
    other replica at once, and once the stall ends the replica serves it again.
    """
    stalled_url, other_url = owner_and_other(platform, "stall-mid")
    stalled_id = Replica.objects.get(url=stalled_url).replica_id
    before = usage_counted(redis_url, platform.prefix)
    raw = platform.client(
        "beta", timeout=INTER_TOKEN_TIMEOUT_S * 4
    ).chat.completions.with_raw_response.create(
        model="chat-7b",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"x-conversation-id": "stall-mid"},
    )
    assert raw.headers["x-replica-id"] == stalled_id
    received = 0
    last_token_at = time.monotonic()
    try:
        with pytest.raises(openai.APIError) as broken:
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    received += 1
                    last_token_at = time.monotonic()
                    if received == 5:
                        set_faults(platform, stalled_url, stall=True)
        error_after_s = time.monotonic() - last_token_at
        assert "mid-stream" in str(broken.value)
        assert received >= 5
        # From the replica's last bytes, which reached the client a little later.
        assert error_after_s >= INTER_TOKEN_TIMEOUT_S - 0.25
        assert error_after_s < INTER_TOKEN_TIMEOUT_S + LATE_S
        assert_released(
            redis_url,
            platform,
            remaining=int(raw.headers["x-ratelimit-remaining-tokens"]),
            refund=MAX_TOKENS - received,
        )
        wait_until(
            lambda: (
                usage_counted(redis_url, platform.prefix)
                == (before[0] + 1, before[1] + received)
            ),
            timeout_s=10,
            message="the broken stream's usage to be counted",
        )
        # The hung engine still holds the request (it takes no abort): the agent
        # marks it stalled, and the gateway routes around it without waiting.
        wait_until(
            lambda: Replica.objects.get(replica_id=stalled_id).state == "stalled",
            timeout_s=STALL_AFTER_S + 15,
            message="the agent to mark the replica stalled",
        )
        # The agent stores the state before it publishes the tick's beat.
        beats = redis.Redis.from_url(redis_url)
        wait_until(
            lambda: (
                beats.hget(f"{platform.prefix}:beat:{stalled_id}", "state")
                == b"stalled"
            ),
            timeout_s=10,
            message="the agent's beat to say stalled",
        )
        started = time.monotonic()
        moved = platform.client("beta").chat.completions.create(
            model="chat-7b",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=2,
            extra_headers={"x-conversation-id": "stall-mid"},
        )
        assert time.monotonic() - started < FIRST_TOKEN_TIMEOUT_S
        assert Replica.objects.get(replica_id=extra_of(moved)["replica_id"]).url == (
            other_url
        )
    finally:
        set_faults(platform, stalled_url, stall=False)
    wait_until(
        lambda: Replica.objects.get(replica_id=stalled_id).state == "serving",
        timeout_s=15,
        message="the replica to serve again once it moves",
    )
    returns_to(platform, "stall-mid", stalled_url)


def test_streams_up_to_the_cap_are_admitted_after_the_stalls(
    platform: LivePlatform,
) -> None:
    """Nothing the stalled streams held is still held: beta's two slots admit two
    streams at once, and a third is refused with 429."""
    opened: list[httpx.Response] = []
    with httpx.Client(timeout=30) as http:
        try:
            for _ in range(BETA_MAX_CONCURRENCY):
                request = http.build_request(
                    "POST",
                    f"{platform.url}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {platform.keys['beta']}"},
                    json={
                        "model": "chat-7b",
                        "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 200,
                        "stream": True,
                        "ignore_eos": True,
                    },
                )
                opened.append(http.send(request, stream=True))
            assert [r.status_code for r in opened] == [200] * BETA_MAX_CONCURRENCY
            third = ask(platform, "beta", max_tokens=1)
            assert third.status_code == 429
            assert third.json()["error"]["code"] == "concurrency_limit_exceeded"
        finally:
            for response in opened:
                response.close()


def test_a_request_larger_than_the_bucket_gets_the_rate_limit_headers(
    platform: LivePlatform,
) -> None:
    response = ask(platform, "beta", max_tokens=BETA_TOKENS_PER_MINUTE + 1)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "request_exceeds_token_limit"
    assert response.headers["x-ratelimit-limit-tokens"] == str(BETA_TOKENS_PER_MINUTE)
    remaining = int(response.headers["x-ratelimit-remaining-tokens"])
    assert 0 <= remaining <= BETA_TOKENS_PER_MINUTE
    assert response.headers["x-ratelimit-reset-tokens"].endswith("s")
