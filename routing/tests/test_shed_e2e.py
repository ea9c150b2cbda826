"""Every 503 a gateway answers is counted: in the usage rows and per team in Prometheus.

A real gateway, agent and replica (``tests.live.start_platform``), the openai SDK
with no retries. Two kinds of 503, one team each so their rows stay apart:

- beta's batch requests are shed by admission (the batch ceiling is one token of
  the pool, less than any request, so batch only ever waits, and waits longer
  than ``PLATFORM_ADMISSION_MAX_WAIT_S``):
  ``pool_overloaded``, cause ``overload``;
- alpha's requests pinned to v2, a version with no replica: admitted, then no
  replica can start an answer: ``no_replica_available``, cause ``no_replica``.

Both land in the usage row's ``shed`` column (``routing.request_meter``: why one
column) with no request and no token billed, and in ``platform_team_shed_total``
with their cause.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

import openai
import pytest
from django.db.models import Sum
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from localrun.processes import wait_until
from metering.models import Usage
from tests.live import LivePlatform, start_platform

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OVERLOAD_SHEDS = 3
NO_REPLICA_SHEDS = 2
COUNTED = ("requests", "prompt_tokens", "output_tokens", "shed", "rate_limited")


@pytest.fixture(scope="module")
def platform(
    django_db_setup: None,
    django_db_blocker: DjangoDbBlocker,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LivePlatform]:
    tmp = tmp_path_factory.mktemp("shed")
    with (
        django_db_blocker.unblock(),
        start_platform(
            tmp,
            pools={"v1": 1, "v2": 0},
            replica_tokens_in_flight=1000,
            PLATFORM_BATCH_CEILING="0.001",
            PLATFORM_ADMISSION_MAX_WAIT_S="0.2",
        ) as live,
    ):
        yield live


def _refused(
    live: LivePlatform, team: str, model: str, headers: dict[str, str]
) -> openai.APIStatusError:
    """Send one chat request that must be refused; return the SDK's error."""
    with pytest.raises(openai.APIStatusError) as refused:
        live.client(team).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
            extra_headers=headers,
        )
    return refused.value


def _usage(live: LivePlatform, team: str, version: str) -> dict[str, int]:
    """Flush the gateway's usage (Redis mode) and sum the team's rows of ``version``."""
    if os.environ.get("REDIS_URL"):
        import redis

        from metering.services import flush_redis_usage

        flush_redis_usage(
            client=redis.Redis.from_url(os.environ["REDIS_URL"]),
            prefix=live.prefix,
            now=timezone.now() + timedelta(minutes=2),
        )
    # Without Redis the gateway flushes its memory itself, every second.
    sums = Usage.objects.filter(
        team_id=team, model_id="chat-7b", version__version=version
    ).aggregate(**{name: Sum(name) for name in COUNTED})
    return {name: value or 0 for name, value in sums.items()}


def _shed_metric(live: LivePlatform) -> dict[tuple[str, str, str], float]:
    """Return ``platform_team_shed_total`` as {(team, tier, cause): value}."""
    found = {}
    for family in text_string_to_metric_families(live.metrics()):
        if family.name != "platform_team_shed":
            continue
        for sample in family.samples:
            if sample.name == "platform_team_shed_total":
                labels = sample.labels
                key = (labels["team"], labels["tier"], labels["cause"])
                found[key] = sample.value
    return found


def test_every_503_is_counted_in_usage_and_per_team(
    platform: LivePlatform, unblocked: None
) -> None:
    for _ in range(OVERLOAD_SHEDS):
        error = _refused(platform, "beta", "chat-7b", {"x-priority": "batch"})
        assert error.status_code == 503
        assert error.code == "pool_overloaded"
        assert error.response.headers["retry-after"]
    for _ in range(NO_REPLICA_SHEDS):
        error = _refused(platform, "alpha", "chat-7b@v2", {})
        assert error.status_code == 503
        assert error.code == "no_replica_available"
        assert error.response.headers["retry-after"]

    expected = {
        ("beta", "v1"): OVERLOAD_SHEDS,
        ("alpha", "v2"): NO_REPLICA_SHEDS,
    }

    def flushed() -> dict[tuple[str, str], dict[str, int]] | None:
        rows = {key: _usage(platform, *key) for key in expected}
        if all(rows[key]["shed"] >= shed for key, shed in expected.items()):
            return rows
        return None

    rows = wait_until(flushed, timeout_s=30, message="the 503s in the usage rows")
    # A 503 is counted once, as shed, and billed nothing.
    nothing = dict.fromkeys(COUNTED, 0)
    assert rows[("beta", "v1")] == {**nothing, "shed": OVERLOAD_SHEDS}
    assert rows[("alpha", "v2")] == {**nothing, "shed": NO_REPLICA_SHEDS}

    shed = _shed_metric(platform)
    assert shed.get(("beta", "batch", "overload")) == OVERLOAD_SHEDS
    assert shed.get(("alpha", "standard", "no_replica")) == NO_REPLICA_SHEDS
    assert ("beta", "batch", "no_replica") not in shed
    assert not any(cause == "overload" for team, _, cause in shed if team == "alpha")
