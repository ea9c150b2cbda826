"""The platform runs on the servers it is given: PostgreSQL and Redis when configured."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING

import pytest
from django.conf import settings
from django.core.cache import cache
from django.core.checks import run_checks
from django.db import connection

from config.checks import check_batch_storage, check_secret_key, check_storage_roots
from config.startup import describe_backends

if TYPE_CHECKING:
    from pytest_django import Settings


def test_database_is_the_one_configured() -> None:
    url = os.environ.get("DATABASE_URL", "")
    expected = "postgresql" if url.startswith(("postgres", "pgsql")) else "sqlite"
    assert connection.vendor == expected


@pytest.mark.django_db
def test_postgres_server_answers(postgres: None) -> None:
    with connection.cursor() as cursor:
        cursor.execute("select version()")
        assert "PostgreSQL" in cursor.fetchone()[0]


def test_redis_cache_round_trips_on_the_real_server(redis_url: str) -> None:
    assert redis_url == settings.REDIS_URL
    assert settings.CACHES["default"]["BACKEND"].endswith("RedisCache")
    key = f"test:{uuid.uuid4()}"
    cache.set(key, {"tokens": 5}, timeout=30)
    assert cache.get(key) == {"tokens": 5}
    cache.delete(key)
    assert cache.get(key) is None


def test_celery_broker_follows_redis_url() -> None:
    if settings.REDIS_URL:
        assert settings.CELERY_BROKER_URL == settings.REDIS_URL
    else:
        assert settings.CELERY_BROKER_URL == "filesystem://"


def test_describe_backends_says_when_stand_ins_are_used(settings: Settings) -> None:
    settings.REDIS_URL = ""
    settings.SECRET_KEY_IS_EPHEMERAL = True
    text = "\n".join(describe_backends())
    assert "REDIS_URL unset" in text
    assert "in-memory" in text
    assert "SECRET_KEY unset" in text
    settings.REDIS_URL = "redis://127.0.0.1:6379/0"
    settings.SECRET_KEY_IS_EPHEMERAL = False
    text = "\n".join(describe_backends())
    assert "REDIS_URL unset" not in text
    assert "secret key" not in text


def test_secret_key_check_warns_only_when_ephemeral(settings: Settings) -> None:
    settings.SECRET_KEY_IS_EPHEMERAL = True
    assert [m.id for m in check_secret_key()] == ["config.W001"]
    settings.SECRET_KEY_IS_EPHEMERAL = False
    assert check_secret_key() == []


def test_storage_roots_check(settings: Settings) -> None:
    settings.PLATFORM_STORAGE_ROOTS = ["s3://models/", "/no/scheme/", "s3://no-slash"]
    assert [m.id for m in check_storage_roots()] == ["config.E002", "config.E002"]
    settings.PLATFORM_STORAGE_ROOTS = []
    assert [m.id for m in check_storage_roots()] == ["config.E001"]


def test_batch_storage_must_lie_under_a_root(settings: Settings) -> None:
    settings.PLATFORM_STORAGE_ROOTS = ["s3://models/"]
    settings.PLATFORM_BATCH_STORAGE_URI = "s3://models/batches/"
    assert check_batch_storage() == []
    settings.PLATFORM_BATCH_STORAGE_URI = "s3://elsewhere/batches/"
    assert [m.id for m in check_batch_storage()] == ["batches.E001"]
    settings.PLATFORM_BATCH_STORAGE_URI = "s3://models/batches"
    assert [m.id for m in check_batch_storage()] == ["batches.E001"]


def test_project_passes_its_system_checks() -> None:
    errors = [m for m in run_checks() if m.is_serious()]
    assert errors == []


def test_heartbeat_check_refuses_a_faster_database_beat(settings: Settings) -> None:
    from config.checks import check_heartbeats

    settings.PLATFORM_HEARTBEAT_S = 1.0
    settings.PLATFORM_HEARTBEAT_DB_S = 0.5
    assert [m.id for m in check_heartbeats()] == ["config.E003"]
    settings.PLATFORM_HEARTBEAT_DB_S = 5.0
    assert check_heartbeats() == []


@pytest.mark.parametrize(
    ("ceiling", "ids"),
    [(0.0, ["routing.E002"]), (1.5, ["routing.E002"]), (0.9, []), (1.0, [])],
)
def test_batch_ceiling_check_keeps_it_in_the_admission_queues_range(
    settings: Settings, ceiling: float, ids: list[str]
) -> None:
    from config.checks import check_batch_ceiling

    settings.PLATFORM_BATCH_CEILING = ceiling
    assert [m.id for m in check_batch_ceiling()] == ids


@pytest.mark.parametrize(
    ("lane", "ids"),
    [(0.0, ["routing.E003"]), (1.2, ["routing.E003"]), (0.2, []), (1.0, [])],
)
def test_batch_lane_check_keeps_it_in_the_admission_queues_range(
    settings: Settings, lane: float, ids: list[str]
) -> None:
    from config.checks import check_batch_ceiling

    settings.PLATFORM_BATCH_LANE = lane
    assert [m.id for m in check_batch_ceiling()] == ids


def test_batch_checks_report_a_bad_ceiling_and_a_bad_lane_together(
    settings: Settings,
) -> None:
    from config.checks import check_batch_ceiling

    settings.PLATFORM_BATCH_CEILING = 0.0
    settings.PLATFORM_BATCH_LANE = 2.0
    assert [m.id for m in check_batch_ceiling()] == ["routing.E002", "routing.E003"]
