"""Tier entitlements and USD budgets end to end: a real gateway, replicas, Redis,
PostgreSQL, and the ``openai`` SDK as the client.

A tier the team may not use is a 403 ``tier_not_entitled`` that charges nothing;
a team past its hard budget gets 429 ``budget_exceeded`` with Retry-After at the
next calendar month (UTC), and is served again once the budget is raised.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import openai
import pytest
import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone
from pytest_django import DjangoDbBlocker

from accounts import services as accounts
from accounts.models import TeamBudget, TeamEntitlement
from localrun.processes import start_gateway, wait_until
from metering.domain.cost import TokenWeights, usd_per_million_at_full
from metering.models import Usage
from metering.services import flush_redis_usage
from models_registry.models import ModelVersion
from routing.domain.budget import NANO_PER_USD, Price
from routing.services import month_budgets, replica_capacity
from tests.live import LivePlatform

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEAM = "budgeted"
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "hello"}
]


@pytest.fixture(scope="module")
def team(
    shared_platform: LivePlatform, django_db_blocker: DjangoDbBlocker
) -> Iterator[tuple[LivePlatform, openai.OpenAI]]:
    """A team of its own on the shared platform (conftest.py), with a key and
    limits on chat-7b; its entitlements and budgets are removed after."""
    with django_db_blocker.unblock():
        accounts.create_team(team_id=TEAM)
        _, secret = accounts.issue_key(team_id=TEAM)
        accounts.set_team_limit(
            team_id=TEAM,
            model_id="chat-7b",
            tokens_per_minute=10**6,
            max_concurrency=64,
            guaranteed_share=0.0,
        )
    client = openai.OpenAI(
        base_url=f"{shared_platform.url}/v1", api_key=secret, max_retries=0
    )
    wait_until(
        functools.partial(_status, client, "standard", 200),
        timeout_s=20,
        message="the new team's key in the gateway",
    )
    try:
        yield shared_platform, client
    finally:
        with django_db_blocker.unblock():
            TeamEntitlement.objects.filter(team_id=TEAM).delete()
            TeamBudget.objects.filter(team_id=TEAM).delete()


def _ask(client: openai.OpenAI, tier: str) -> None:
    client.chat.completions.create(
        model="chat-7b",
        messages=MESSAGES,
        max_tokens=16,
        extra_headers={"x-priority": tier},
    )


def _status(client: openai.OpenAI, tier: str, wanted: int) -> bool:
    try:
        _ask(client, tier)
    except openai.APIStatusError as exc:
        return exc.status_code == wanted
    return wanted == 200


def _bucket_exists(platform: LivePlatform, redis_url: str) -> bool:
    with redis.Redis.from_url(redis_url) as client:
        return bool(client.exists(f"{platform.prefix}:bucket:{TEAM}:chat-7b"))


def test_a_tier_the_team_may_not_use_is_403_and_charges_nothing(
    team: tuple[LivePlatform, openai.OpenAI], unblocked: None, redis_url: str
) -> None:
    """GIVEN the team entitled to batch only on chat-7b
    WHEN it asks for interactive and standard
    THEN each is a 403 tier_not_entitled in OpenAI's shape, its token bucket is
    never charged, and a batch request is served."""
    platform, client = team
    accounts.set_team_entitlement(team_id=TEAM, model_id="chat-7b", tiers=["batch"])
    wait_until(
        functools.partial(_status, client, "standard", 403),
        timeout_s=20,
        message="the entitlement in the gateway",
    )
    # The requests served while waiting for the key charged the bucket: drop it
    # (an absent bucket is a full one), so a charge would show as a new key.
    with redis.Redis.from_url(redis_url) as r:
        r.delete(f"{platform.prefix}:bucket:{TEAM}:chat-7b")
    for tier in ("interactive", "standard"):
        with pytest.raises(openai.PermissionDeniedError) as refused:
            _ask(client, tier)
        error = refused.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "tier_not_entitled"
        assert error["type"] == "permission_error"
        assert error["param"] == "x-priority"
        assert "x-ratelimit-remaining-tokens" not in refused.value.response.headers
    assert not _bucket_exists(platform, redis_url), "a refused tier was charged"
    _ask(client, "batch")
    assert _bucket_exists(platform, redis_url)  # what a served request leaves
    # Without the row, the operator's default (every tier) again.
    TeamEntitlement.objects.filter(team_id=TEAM).delete()
    wait_until(
        functools.partial(_status, client, "interactive", 200),
        timeout_s=20,
        message="the default tiers back in the gateway",
    )


def test_a_team_past_its_hard_budget_gets_429_until_it_is_raised(
    team: tuple[LivePlatform, openai.OpenAI], unblocked: None
) -> None:
    """GIVEN a budget of 0.0001 USD on all the team's models
    WHEN the team sends requests one after another
    THEN after a few it gets 429 budget_exceeded with Retry-After at the start
    of next month, the spend gauge is past the soft threshold, and once the
    budget is raised the team is served again."""
    platform, client = team
    accounts.set_team_budget(team_id=TEAM, model_id=None, monthly_usd=0.0001)

    def refused() -> openai.RateLimitError | None:
        try:
            _ask(client, "standard")
        except openai.RateLimitError as exc:
            return exc
        return None

    error = wait_until(refused, timeout_s=30, message="the budget's 429")
    body = error.response.json()["error"]
    assert body["code"] == "budget_exceeded"
    assert body["type"] == "rate_limit_error"
    now = datetime.now(UTC)
    next_month = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    retry_after = int(error.response.headers["retry-after"])
    assert abs(retry_after - (next_month - now).total_seconds()) < 30
    # Refused again at once: the refusal held nothing.
    with pytest.raises(openai.RateLimitError):
        _ask(client, "standard")
    ratio = _gauge(platform, "platform_team_budget_spend_ratio")
    assert ratio is not None, [
        line for line in platform.metrics().splitlines() if "budget" in line
    ]
    assert ratio > 0.8
    accounts.set_team_budget(team_id=TEAM, model_id=None, monthly_usd=1000.0)
    wait_until(
        functools.partial(_status, client, "standard", 200),
        timeout_s=20,
        message="the raised budget in the gateway",
    )


def _gauge(platform: LivePlatform, name: str) -> float | None:
    # The exposition sorts a series' labels by name.
    prefix = f'{name}{{model="*",team="{TEAM}"}} '
    for line in platform.metrics().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return None


# -- the overshoot over HTTP ---------------------------------------------------------

SPENDER = "overspender"
BUDGET_USD = 0.002
CLIENTS = 12


@pytest.fixture(scope="module")
def spender(
    shared_platform: LivePlatform,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LivePlatform, list[str], str]]:
    """A team with a hard budget of BUDGET_USD on all its models, and a second
    gateway beside the shared platform's, on the same Redis and prefix; yield the
    platform, both gateways' URLs and the team's key. The team, its key and its
    budget are committed at once, so a snapshot that knows the key knows the
    budget: no request of the team is ever served unbudgeted."""
    second = None
    with django_db_blocker.unblock():
        with transaction.atomic():
            accounts.create_team(team_id=SPENDER)
            _, secret = accounts.issue_key(team_id=SPENDER)
            accounts.set_team_limit(
                team_id=SPENDER,
                model_id="chat-7b",
                tokens_per_minute=10**7,
                max_concurrency=64,
                guaranteed_share=0.0,
            )
            accounts.set_team_budget(
                team_id=SPENDER, model_id=None, monthly_usd=BUDGET_USD
            )
        second = start_gateway(
            shared_platform.env, tmp_path_factory.mktemp("budget"), name="gateway-2"
        )
    try:
        urls = [shared_platform.url, second.url]
        for url in urls:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0)
            wait_until(
                functools.partial(_status, client, "standard", 200),
                timeout_s=20,
                message="the spender's key in every gateway",
            )
        yield shared_platform, urls, secret
    finally:
        second.stop()
        with django_db_blocker.unblock():
            TeamBudget.objects.filter(team_id=SPENDER).delete()


def _request_usd(max_tokens: int) -> float:
    """Return about what a request of ours costs: a 12-token prompt and every
    output token (the simulated answers mostly run to ``max_tokens``)."""
    version = ModelVersion.objects.get(model_id="chat-7b", version="v1")
    gpus, tokens_per_s = replica_capacity(
        version.gpus_per_replica, version.load_test_tokens_per_s
    )
    usd_per_million = usd_per_million_at_full(
        gpus_per_replica=gpus,
        gpu_hour_usd=settings.PLATFORM_GPU_HOUR_USD,
        tokens_per_s=tokens_per_s,
    )
    weights = TokenWeights(**settings.PLATFORM_COST_WEIGHTS)
    price = Price(usd_per_million=usd_per_million, weights=weights)
    return (
        price.cost_nano(prompt_tokens=12, cached_tokens=0, output_tokens=max_tokens)
        / NANO_PER_USD
    )


async def _spend(
    urls: list[str], key: str, offered: int
) -> tuple[list[openai.types.CompletionUsage], list[str], float]:
    """Send ``offered`` requests from CLIENTS clients at once, alternating between
    the gateways; return the served answers' usage, the refusals' codes and the
    seconds it took."""
    clients = [
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        for url in urls
    ]
    served: list[openai.types.CompletionUsage] = []
    refused: list[str] = []
    left = list(range(offered))
    started = time.monotonic()

    async def ask(sdk: openai.AsyncOpenAI, n: int) -> openai.types.CompletionUsage:
        """One request; every third streams (its usage in the final event)."""
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "user", "content": f"spend {n % 7}"}
        ]
        max_tokens = 8 + n % 57  # 8 to 64: each reserves its own worst case
        if n % 3:
            answer = await sdk.chat.completions.create(
                model="chat-7b", messages=messages, max_tokens=max_tokens, seed=n
            )
            assert answer.usage is not None
            return answer.usage
        stream = await sdk.chat.completions.create(
            model="chat-7b",
            messages=messages,
            max_tokens=max_tokens,
            seed=n,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        return usage

    async def client(index: int) -> None:
        while left:
            n = left.pop()
            try:
                served.append(await ask(clients[(index + n) % len(clients)], n))
            except openai.RateLimitError as exc:
                refused.append(exc.response.json()["error"]["code"])

    try:
        await asyncio.gather(*(client(i) for i in range(CLIENTS)))
    finally:
        for sdk in clients:
            await sdk.close()
    return served, refused, time.monotonic() - started


def test_a_team_at_three_times_its_budget_overshoots_it_by_under_one_percent(
    spender: tuple[LivePlatform, list[str], str], unblocked: None, redis_url: str
) -> None:
    """GIVEN a team with a hard budget and two gateways on one Redis
    WHEN 12 clients at once send three times the requests the budget pays for,
    alternating between the gateways, until refusals are 429 budget_exceeded
    THEN, once the usage has flushed to the database, the team's spend priced
    from the usage rows is at most 1% past the budget (the bound of
    docs/finance.md: each request reserves its worst case, its prompt and every
    output token ``max_tokens`` allows, before admission), and the budget was
    used (at least 90% of it)."""
    platform, urls, key = spender
    offered = round(3 * BUDGET_USD / _request_usd(36))
    served, refused, took_s = asyncio.run(_spend(urls, key, offered))
    assert refused, "three times the budget must be refused in part"
    assert set(refused) == {"budget_exceeded"}
    requests = 2 + len(served)  # and the two that found the key in the gateways

    # What the beat's flush does, for every minute (the last one closed early):
    # the gateways count usage in Redis, under the platform's prefix.
    with redis.Redis.from_url(redis_url) as client:
        flush_redis_usage(
            client=client,
            prefix=platform.prefix,
            now=timezone.now() + timedelta(minutes=2),
            region=platform.region,
        )
    totals = Usage.objects.filter(team_id=SPENDER).aggregate(
        requests=Sum("requests"),
        prompt=Sum("prompt_tokens"),
        output=Sum("output_tokens"),
    )
    assert totals["requests"] == requests
    # Billed what the clients were told, and at most the two probes' 16 more.
    told = sum(u.completion_tokens for u in served)
    assert told <= totals["output"] <= told + 2 * 16
    month = datetime.now(UTC).strftime("%Y-%m")
    budget = month_budgets(region=platform.region, month=month, team_id=SPENDER)[
        (SPENDER, "")
    ]
    spent = budget.spent_here_usd + budget.spent_elsewhere_usd
    overshoot = (spent - BUDGET_USD) / BUDGET_USD
    print(
        f"budget overshoot over HTTP: {overshoot:+.4%} of {BUDGET_USD} USD; "
        f"{len(served)} served, {len(refused)} refused of {offered} in {took_s:.1f} s"
    )
    assert overshoot <= 0.01
    assert spent >= 0.9 * BUDGET_USD
