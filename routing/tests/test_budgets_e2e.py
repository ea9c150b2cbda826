"""Tier entitlements and USD budgets end to end: a real gateway, replicas, Redis,
PostgreSQL, and the ``openai`` SDK as the client.

A tier the team may not use is a 403 ``tier_not_entitled`` that charges nothing;
a team past its hard budget gets 429 ``budget_exceeded`` with Retry-After at the
next calendar month (UTC), and is served again once the budget is raised.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from datetime import UTC, datetime

import openai
import pytest
import redis
from pytest_django import DjangoDbBlocker

from accounts import services as accounts
from accounts.models import TeamBudget, TeamEntitlement
from localrun.processes import wait_until
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
