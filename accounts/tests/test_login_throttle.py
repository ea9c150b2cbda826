"""The console login locks a user name and address out after wrong passwords.

The counts live in the real cache (Redis under REDIS_URL). Every test uses user
names and an address of its own, so tests never share a count; what they leave
behind expires with the lockout.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import pytest
import time_machine
from django.contrib.auth import get_user_model
from django.test import Client

if TYPE_CHECKING:
    from pytest_django import Settings

LOGIN = "/console/login/"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
PASSWORD = "correct horse battery staple"


@pytest.fixture
def operator(db: None, settings: Settings) -> str:
    """Return the user name of a console superuser of this test's own."""
    # A fast hasher: these tests check hundreds of passwords, not the hashing.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    name = f"operator-{uuid.uuid4().hex[:8]}"
    get_user_model().objects.create_superuser(name, "", PASSWORD)
    return name


@pytest.fixture
def address() -> str:
    """Return a client address of this test's own (from TEST-NET-2)."""
    return f"198.51.{uuid.uuid4().int % 256}.{uuid.uuid4().int % 256}"


def log_in(username: str, password: str, ip: str) -> bool:
    """Post the console's login form from ``ip``; return True if it logged in."""
    client = Client(REMOTE_ADDR=ip)
    response = client.post(
        LOGIN, {"username": username, "password": password, "next": "/console/"}
    )
    is_in = "_auth_user_id" in client.session
    assert is_in == (response.status_code == 302), response.status_code
    return is_in


def page_after(username: str, password: str, ip: str) -> str:
    client = Client(REMOTE_ADDR=ip)
    response = client.post(LOGIN, {"username": username, "password": password})
    return response.content.decode()


def test_right_password_is_refused_after_five_wrong_ones_until_the_lockout_ends(
    operator: str, address: str
) -> None:
    """GIVEN 15 wrong passwords for one user from one address (the issue's probe)
    WHEN the right one follows
    THEN it is refused with a message, and accepted once 15 minutes have passed.
    """
    with time_machine.travel(T0, tick=False) as clock:
        assert [log_in(operator, f"wrong-{i}", address) for i in range(15)] == [
            False
        ] * 15
        assert not log_in(operator, PASSWORD, address)
        assert "Too many failed logins. Try again in 15 minute(s)." in page_after(
            operator, PASSWORD, address
        )
        clock.shift(timedelta(minutes=14, seconds=59))
        assert not log_in(operator, PASSWORD, address)
        clock.shift(timedelta(seconds=2))
        assert log_in(operator, PASSWORD, address)


def test_lockout_of_one_address_leaves_the_account_open_from_others(
    operator: str, address: str
) -> None:
    with time_machine.travel(T0, tick=False):
        for i in range(5):
            log_in(operator, f"wrong-{i}", address)
        assert not log_in(operator, PASSWORD, address)
        assert log_in(operator, PASSWORD, f"203.0.113.{uuid.uuid4().int % 256}")


def test_a_login_clears_the_count_of_its_user_and_address(
    operator: str, address: str
) -> None:
    with time_machine.travel(T0, tick=False):
        for round_ in range(3):
            for i in range(4):
                assert not log_in(operator, f"wrong-{round_}-{i}", address)
            assert log_in(operator, PASSWORD, address)


def test_one_address_cannot_spread_its_guesses_over_user_names(
    operator: str, address: str
) -> None:
    with time_machine.travel(T0, tick=False):
        names = [f"guess-{i}" for i in range(20)]
        for name in names:
            assert not log_in(name, "wrong", address)
        assert not log_in(operator, PASSWORD, address)


def test_case_variants_of_a_user_name_share_one_count(
    operator: str, address: str
) -> None:
    with time_machine.travel(T0, tick=False):
        for i, name in enumerate([operator, operator.upper(), operator.title()] * 2):
            log_in(name, f"wrong-{i}", address)
        assert not log_in(operator, PASSWORD, address)
