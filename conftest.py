"""Fixtures shared by every app's tests.

With ``REQUIRE_SERVICES=1`` (CI), a PostgreSQL or Redis server named by
``DATABASE_URL`` / ``REDIS_URL`` that cannot be reached fails the run instead of
skipping the tests that need it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from rest_framework.test import APIClient

from accounts import services as accounts_services
from models_registry import services as registry_services
from tests.factories import VERSION_BODY

REQUIRE_SERVICES = os.environ.get("REQUIRE_SERVICES", "") == "1"


def _service_missing(what: str) -> None:
    if REQUIRE_SERVICES:
        pytest.fail(f"{what} is required (REQUIRE_SERVICES=1) but unreachable")
    pytest.skip(f"{what} is not available")


@pytest.fixture(scope="session")
def django_db_setup(django_test_environment: None, django_db_blocker, django_db_keepdb):  # type: ignore[no-untyped-def]
    """Create the test database whenever any test runs, not only for `db` tests.

    pytest-django sets up only the databases that the selected tests mark; the
    end-to-end tests share the database with processes they start and never use
    the `db` fixture, and without this they would write to the development
    database when run alone.
    """
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        config = setup_databases(
            verbosity=0, interactive=False, keepdb=django_db_keepdb, aliases={"default"}
        )
    yield
    with django_db_blocker.unblock():
        teardown_databases(config, verbosity=0, keepdb=django_db_keepdb)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """Return a reachable REDIS_URL, or skip (fail under REQUIRE_SERVICES=1)."""
    import redis

    url = os.environ.get("REDIS_URL", "")
    if not url:
        _service_missing("Redis (REDIS_URL unset)")
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        _service_missing(f"Redis at {url} ({exc})")
    return url


@pytest.fixture
def admin_secret(db: None) -> str:
    """Return the secret of a fresh admin token."""
    _, secret = accounts_services.create_admin_token(name="tests")
    return secret


@pytest.fixture
def admin_client(admin_secret: str) -> APIClient:
    """Return an API client that sends an admin token."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_secret}")
    return client


@pytest.fixture
def anon_client() -> APIClient:
    """Return an API client that sends no token."""
    return APIClient()


@pytest.fixture
def team(db: None):  # type: ignore[no-untyped-def]
    """Return a team named 'search'."""
    return accounts_services.create_team(team_id="search", name="Search")


@pytest.fixture
def team_secret(team) -> str:  # type: ignore[no-untyped-def]
    """Return the secret of an API key of the 'search' team."""
    _, secret = accounts_services.issue_key(team_id=team.team)
    return secret


@pytest.fixture
def chat_model(db: None):  # type: ignore[no-untyped-def]
    """Return the model 'chat-7b' with no versions."""
    return registry_services.create_model(model_id="chat-7b")


@pytest.fixture
def chat_v1(chat_model):  # type: ignore[no-untyped-def]
    """Return chat-7b@v1, registered from the example body."""
    return registry_services.register_version(model_id="chat-7b", **VERSION_BODY)


@pytest.fixture
def settings_storage_roots(settings) -> Iterator[list[str]]:  # type: ignore[no-untyped-def]
    """Return the configured storage roots (tests may change them via ``settings``)."""
    yield settings.PLATFORM_STORAGE_ROOTS
