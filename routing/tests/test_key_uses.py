"""Team keys' last_used_at: noted in memory per request, written in batches."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest
from django.utils import timezone

from accounts import services as accounts_services
from accounts.models import ApiKey, Team
from routing.key_uses import KeyUses


class Writer:
    """Records each batch; fails the first ``failures`` writes."""

    def __init__(self, failures: int = 0) -> None:
        self.batches: list[frozenset[int]] = []
        self.failures = failures

    async def __call__(self, key_ids: frozenset[int]) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("database unreachable")
        self.batches.append(key_ids)


def test_many_uses_become_one_write_per_flush() -> None:
    writer = Writer()
    uses = KeyUses(writer)

    async def scenario() -> None:
        for _ in range(1000):
            uses.note(7)
        uses.note(8)
        await uses.flush()
        await uses.flush()  # nothing new: no write
        uses.note(8)
        await uses.flush()

    asyncio.run(scenario())
    assert writer.batches == [frozenset({7, 8}), frozenset({8})]


def test_a_failed_write_keeps_the_keys_for_the_next_one() -> None:
    writer = Writer(failures=1)
    uses = KeyUses(writer)

    async def scenario() -> None:
        uses.note(1)
        await uses.flush()  # fails: kept, not raised
        uses.note(2)
        await uses.flush()

    asyncio.run(scenario())
    assert writer.batches == [frozenset({1, 2})]


def test_a_database_outage_is_logged_once_and_its_end_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    writer = Writer(failures=5)
    uses = KeyUses(writer)

    async def scenario() -> None:
        for key_id in range(6):
            uses.note(key_id)
            await uses.flush()

    with caplog.at_level(logging.INFO, logger="routing.key_uses"):
        asyncio.run(scenario())
    assert writer.batches == [frozenset(range(6))]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "writing key last-used times failed (ConnectionError); 1 keys wait",
        "writing key last-used times resumed",
    ]


def test_keys_used_during_a_write_wait_for_the_next() -> None:
    release = asyncio.Event()
    batches: list[frozenset[int]] = []

    async def slow_write(key_ids: frozenset[int]) -> None:
        await release.wait()
        batches.append(key_ids)

    uses = KeyUses(slow_write)

    async def scenario() -> None:
        uses.note(1)
        writing = asyncio.create_task(uses.flush())
        await asyncio.sleep(0)  # the write has taken its batch
        uses.note(2)
        release.set()
        await writing
        await uses.flush()

    asyncio.run(scenario())
    assert batches == [frozenset({1}), frozenset({2})]


@pytest.mark.django_db
def test_touch_api_keys_stamps_the_batch_and_never_moves_back() -> None:
    team = Team.objects.create(team="uses")
    used, other = (
        accounts_services.issue_key(team_id=team.team)[0],
        accounts_services.issue_key(team_id=team.team)[0],
    )
    now = timezone.now()

    assert accounts_services.touch_api_keys(key_ids={used.pk}, now=now) == 1
    assert (
        accounts_services.touch_api_keys(
            key_ids={used.pk}, now=now - timedelta(seconds=30)
        )
        == 0
    )
    assert accounts_services.touch_api_keys(key_ids=set(), now=now) == 0

    stamped = dict(ApiKey.objects.values_list("pk", "last_used_at"))
    assert stamped == {used.pk: now, other.pk: None}
