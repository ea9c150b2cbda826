"""Everything Django serves answers 503 with Retry-After while the database is down."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.db import IntegrityError, OperationalError, connection
from django.test import Client
from rest_framework.test import APIClient

from config.control_plane import is_database_unavailable

if TYPE_CHECKING:
    from pytest_django import Settings


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens once the socket closes


@pytest.fixture
def database_down(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make the next connection of the default database a real refused connect.

    The request's connection is opened against a closed port of 127.0.0.1, so the
    error is the driver's own (``psycopg.OperationalError``, wrapped by Django).
    """
    port = _closed_port()

    def refused(conn_params: dict[str, Any]) -> Any:
        return psycopg.connect(host="127.0.0.1", port=port, connect_timeout=2)

    connection.close()
    monkeypatch.setattr(connection, "get_new_connection", refused)
    yield
    monkeypatch.undo()
    connection.close()


def _assert_unavailable(response: Any, *, retry_after: str = "5") -> None:
    assert response.status_code == 503
    assert response["Retry-After"] == retry_after


@pytest.mark.django_db(transaction=True)
def test_admin_api_answers_503_with_retry_after_while_the_database_is_down(
    admin_secret: str, request: pytest.FixtureRequest
) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_secret}")
    request.getfixturevalue("database_down")
    response = client.put(
        "/admin/teams/alpha/limits",
        {"model": "chat-7b", "tokens_per_minute": 10, "max_concurrency": 1},
        format="json",
    )
    _assert_unavailable(response)
    assert response.json() == {
        "error": {
            "type": "service_unavailable_error",
            "message": "the control plane's database is unavailable; retry later",
            "param": None,
            "code": "control_plane_unavailable",
        }
    }


@pytest.mark.django_db(transaction=True)
def test_files_api_answers_503_while_the_database_is_down(
    team_secret: str, request: pytest.FixtureRequest
) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {team_secret}")
    request.getfixturevalue("database_down")
    response = client.get("/v1/files")
    _assert_unavailable(response)
    assert response.json()["error"]["code"] == "control_plane_unavailable"


@pytest.mark.django_db(transaction=True)
def test_console_page_answers_503_page_while_the_database_is_down(
    settings: Settings, request: pytest.FixtureRequest
) -> None:
    settings.PLATFORM_CONTROL_PLANE_RETRY_AFTER_S = 12.4
    user = get_user_model().objects.create_superuser(
        username="root", email="root@example.com", password="pw-long-enough-1"
    )
    client = Client()
    client.force_login(user)
    request.getfixturevalue("database_down")
    response = client.get("/console/")
    _assert_unavailable(response, retry_after="12")
    assert b"Try again in 12 seconds" in response.content


def test_only_connection_failures_count_as_unavailable() -> None:
    refused = OperationalError("connection refused")
    refused.__cause__ = psycopg.OperationalError("connection refused")
    shutdown = OperationalError("terminating connection")
    shutdown.__cause__ = psycopg.errors.AdminShutdown("terminating connection")
    deadlock = OperationalError("deadlock detected")
    deadlock.__cause__ = psycopg.errors.DeadlockDetected("deadlock detected")
    assert is_database_unavailable(refused)
    assert is_database_unavailable(shutdown)
    assert is_database_unavailable(psycopg.OperationalError("pool timeout"))
    assert not is_database_unavailable(deadlock)
    assert not is_database_unavailable(IntegrityError("duplicate key"))
    assert not is_database_unavailable(ValueError("x"))
