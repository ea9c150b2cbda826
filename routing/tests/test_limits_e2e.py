"""Team limits across gateway processes, on real Redis, with real replicas."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as redis_asyncio
from pytest_django import DjangoDbBlocker

from accounts import services as accounts
from accounts.models import TeamLimit
from localrun.processes import start_gateway, wait_until
from routing.limiter_redis import RedisBucketStore
from tests.live import LivePlatform

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LIMIT = 3_000  # tokens per minute: 50 a second
# 20 s of hammering: the full bucket goes in the first second, then the refill.
# Two buckets (one per gateway) would admit about twice the bound, and a refill
# about 11% too fast would pass it by the one request of slack; the refill's
# arithmetic itself is routing/tests/test_limiter_store.py's, on real Redis.
DURATION_S = float(os.environ.get("PLATFORM_TEST_LIMIT_DURATION_S", "20"))


@pytest.fixture(scope="module")
def two_gateways(
    shared_platform: LivePlatform,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
) -> Iterator[tuple[LivePlatform, str]]:
    """The shared platform (conftest.py; v1 on two replicas) with the teams held to
    LIMIT, and a second gateway beside its own; the seeded limits come back after."""
    live = shared_platform
    tmp = tmp_path_factory.mktemp("limits")
    with django_db_blocker.unblock():
        seeded = _set_limits(tokens_per_minute=LIMIT, max_concurrency=1000)
    second = None
    try:
        with django_db_blocker.unblock():
            second = start_gateway(live.env, tmp, name="gateway-2")
        for url in (live.url, second.url):
            wait_until(
                functools.partial(_has_the_limit, url, live, LIMIT),
                timeout_s=20,
                message="the new limit in every gateway",
            )
        yield live, second.url
    finally:
        if second is not None:
            second.stop()
        with django_db_blocker.unblock():
            _set_limits(**seeded)
        # The modules after this one must not meet LIMIT.
        wait_until(
            functools.partial(
                _has_the_limit, live.url, live, seeded["tokens_per_minute"]
            ),
            timeout_s=20,
            message="the seeded limit back in the gateway",
        )


def _set_limits(*, tokens_per_minute: int, max_concurrency: int) -> dict[str, int]:
    """Set both teams' chat-7b limits; return what beta's were (the seed's, as
    alpha's, with no guaranteed share)."""
    before = TeamLimit.objects.get(team_id="beta", model_id="chat-7b")
    for team in ("alpha", "beta"):
        accounts.set_team_limit(
            team_id=team,
            model_id="chat-7b",
            tokens_per_minute=tokens_per_minute,
            max_concurrency=max_concurrency,
            guaranteed_share=0.0,
        )
    return {
        "tokens_per_minute": before.tokens_per_minute,
        "max_concurrency": before.max_concurrency,
    }


def _has_the_limit(url: str, live: LivePlatform, limit: int) -> bool:
    return _limit_header(url, live) == str(limit)


def _limit_header(url: str, live: LivePlatform) -> str | None:
    import httpx

    response = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {live.keys['beta']}"},
        json={
            "model": "chat-7b",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1,
        },
        timeout=10,
    )
    return response.headers.get("x-ratelimit-limit-tokens")


async def _hammer(
    urls: list[str], key: str, seconds: float
) -> tuple[list[tuple[int, int, float]], float, float]:
    """Send requests from 12 clients alternating between gateways; return outcomes."""
    outcomes: list[tuple[int, int, float]] = []  # (status, charged tokens, time)
    body = {
        "model": "chat-7b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        "ignore_eos": True,
    }
    deadline = time.time() + seconds
    started = time.time()
    async with aiohttp.ClientSession() as session:

        async def client(index: int) -> None:
            n = 0
            while time.time() < deadline:
                url = urls[(index + n) % len(urls)]
                n += 1
                async with session.post(
                    f"{url}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {key}"},
                ) as response:
                    data = await response.json()
                    charged = 0
                    if response.status == 200:
                        charged = data["usage"]["prompt_tokens"] + body["max_tokens"]
                    elif response.status == 429:
                        # A refusal says when to come back; honour it like a client.
                        assert int(response.headers["retry-after"]) >= 1
                    outcomes.append((response.status, charged, time.time()))
                    if response.status == 429:
                        await asyncio.sleep(0.05)

        await asyncio.gather(*(client(i) for i in range(12)))
    return outcomes, started, time.time()


def test_two_gateways_never_admit_more_than_the_limit(
    two_gateways: tuple[LivePlatform, str],
) -> None:
    live, second = two_gateways
    outcomes, started, ended = asyncio.run(
        _hammer([live.url, second], live.keys["beta"], DURATION_S)
    )
    admitted = [o for o in outcomes if o[0] == 200]
    refused = [o for o in outcomes if o[0] == 429]
    assert admitted and refused
    assert {o[0] for o in outcomes} <= {200, 429}
    one_request = max(o[1] for o in admitted)
    allowed = LIMIT + LIMIT / 60 * (ended - started) + one_request
    assert sum(o[1] for o in admitted) <= allowed
    # And the limit was used, not starved: at least the initial bucket went out.
    assert sum(o[1] for o in admitted) >= LIMIT


def test_refund_returns_exactly_what_was_not_used(
    two_gateways: tuple[LivePlatform, str],
) -> None:
    live, _ = two_gateways
    rate = LIMIT / 60

    async def level_at(now: float) -> float:
        client = redis_asyncio.Redis.from_url(os.environ["REDIS_URL"])
        try:
            store = RedisBucketStore(client, live.prefix)
            bucket = await store.peek(
                "alpha:chat-7b", capacity=LIMIT, refill_per_s=rate, now=now
            )
        finally:
            await client.aclose()
        return bucket.tokens

    async def ask() -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{live.url}/v1/chat/completions",
                json={
                    "model": "chat-7b",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1200,
                    "seed": 3,
                },
                headers={"Authorization": f"Bearer {live.keys['alpha']}"},
            ) as response,
        ):
            data = await response.json()
            assert response.status == 200, data
            return data

    t0 = time.time()
    level0 = asyncio.run(level_at(t0))
    used = asyncio.run(ask())["usage"]["total_tokens"]
    assert used < 1200  # the answer stopped early: most of the charge came back

    def refunded() -> tuple[float, float] | None:
        # The gateway refunds just after the answer's last bytes: poll for it.
        t1 = time.time()
        level1 = asyncio.run(level_at(t1))
        expected = level0 - used + rate * (t1 - t0)
        # The bucket was full until the charge, so refill between t0 and the
        # charge (the request's way through the gateway, well under 100 ms) did not
        # count; a missing refund would be off by the ~1,000 unused tokens.
        if expected - rate * 0.1 <= level1 <= expected + 0.01:
            return level1, expected
        return None

    found = wait_until(refunded, timeout_s=5, message="the refund")
    assert found is not None  # wait_until returns only a truthy value
    level1, expected = found
    assert expected < LIMIT  # not hidden by the bucket's cap
    assert level1 < level0  # what was used stayed spent
