"""DATABASES as settings build it from the environment, read in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from localrun.processes import ROOT

PRINT_DATABASE = (
    "import json, django; django.setup(); from django.conf import settings; "
    "d = settings.DATABASES['default']; "
    "print(json.dumps({k: d.get(k) for k in ('CONN_MAX_AGE', 'OPTIONS')}))"
)


def settings_process(**env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("PLATFORM_DB_")
    }
    environ.update(
        {
            "DATABASE_URL": "postgresql://u@127.0.0.1:5432/platform?sslmode=prefer",
            "DJANGO_SETTINGS_MODULE": "config.settings",
            **env,
        }
    )
    return subprocess.run(
        [sys.executable, "-c", PRINT_DATABASE],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# What every PostgreSQL connection gets by default (PLATFORM_DB_TCP_TIMEOUT_S=10).
DEAD_PEER_OPTIONS = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10000,
}


def database(**env: str) -> dict[str, Any]:
    process = settings_process(**env)
    assert process.returncode == 0, process.stderr
    return dict(json.loads(process.stdout.splitlines()[-1]))


def test_postgres_connections_come_from_a_bounded_pool_by_default() -> None:
    settings = database()
    assert settings["CONN_MAX_AGE"] == 0
    assert settings["OPTIONS"] == {
        "sslmode": "prefer",
        **DEAD_PEER_OPTIONS,
        "pool": {
            "min_size": 1,
            "max_size": 10,
            "timeout": 5.0,
            "reconnect_timeout": 10.0,
        },
    }


def test_pool_size_and_timeout_come_from_the_environment() -> None:
    pool = database(
        PLATFORM_DB_POOL_MAX_SIZE="4",
        PLATFORM_DB_POOL_MIN_SIZE="0",
        PLATFORM_DB_POOL_TIMEOUT_S="2.5",
    )["OPTIONS"]["pool"]
    assert pool == {
        "min_size": 0,
        "max_size": 4,
        "timeout": 2.5,
        "reconnect_timeout": 5.0,
    }


def test_pool_size_zero_means_no_pool_and_no_persistent_connections() -> None:
    settings = database(PLATFORM_DB_POOL_MAX_SIZE="0")
    assert settings == {
        "CONN_MAX_AGE": 0,
        "OPTIONS": {"sslmode": "prefer", **DEAD_PEER_OPTIONS},
    }


def test_a_silent_database_breaks_connections_within_the_tcp_timeout() -> None:
    """A blackholed database must fail queries in seconds, not the kernel's minutes;
    the URL's own options win."""
    options = database(PLATFORM_DB_TCP_TIMEOUT_S="4")["OPTIONS"]
    assert options["tcp_user_timeout"] == 4000
    assert options["connect_timeout"] == 2
    assert options["keepalives_idle"] == 2
    mine = database(DATABASE_URL="postgresql://u@db.example:5432/p?connect_timeout=30")[
        "OPTIONS"
    ]
    assert mine["connect_timeout"] == "30"
    assert mine["tcp_user_timeout"] == 10000


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"PLATFORM_DB_CONN_MAX_AGE_S": "60"},
            "PLATFORM_DB_CONN_MAX_AGE_S was removed",
        ),
        (
            {"PLATFORM_DB_POOL_MIN_SIZE": "5", "PLATFORM_DB_POOL_MAX_SIZE": "4"},
            "PLATFORM_DB_POOL_MIN_SIZE must not exceed PLATFORM_DB_POOL_MAX_SIZE",
        ),
        ({"PLATFORM_DB_POOL_MAX_SIZE": "many"}, "PLATFORM_DB_POOL_MAX_SIZE"),
    ],
)
def test_bad_pool_settings_stop_the_process(env: dict[str, str], message: str) -> None:
    process = settings_process(**env)
    assert process.returncode != 0
    assert message in process.stderr
