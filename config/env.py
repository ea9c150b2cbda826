"""Strict, typed readers for settings taken from the environment.

Public surface: ``env_str``, ``env_int``, ``env_float``, ``env_bool``, ``env_list``,
``env_networks``, ``env_secret``, ``parse_database_url`` and ``EnvError``.

Every reader raises ``EnvError`` naming the variable when a value is present but
malformed: a typo in production must stop the process at start, not fall back to a
default silently. Each variable is documented in ``docs/configuration.md``.
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

__all__ = [
    "EnvError",
    "dead_peer_options",
    "env_bool",
    "env_float",
    "env_int",
    "env_list",
    "env_networks",
    "env_secret",
    "env_str",
    "parse_database_url",
]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class EnvError(ValueError):
    """A variable is set but cannot be read as the type its setting needs."""


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    value = (os.environ if environ is None else environ).get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def env_str(name: str, default: str, environ: Mapping[str, str] | None = None) -> str:
    """Return the variable as text, or ``default`` when unset or empty."""
    value = _raw(name, environ)
    return default if value is None else value


def env_int(
    name: str,
    default: int,
    environ: Mapping[str, str] | None = None,
    *,
    minimum: int | None = None,
) -> int:
    """Return the variable as an integer; reject anything else, and values below ``minimum``."""
    value = _raw(name, environ)
    if value is None:
        return default
    try:
        number = int(value, 10)
    except ValueError:
        raise EnvError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise EnvError(f"{name} must be at least {minimum}, got {number}")
    return number


def env_float(
    name: str,
    default: float,
    environ: Mapping[str, str] | None = None,
    *,
    minimum: float | None = None,
) -> float:
    """Return the variable as a finite float; reject anything else."""
    value = _raw(name, environ)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise EnvError(f"{name} must be a number, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise EnvError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and number < minimum:
        raise EnvError(f"{name} must be at least {minimum}, got {number}")
    return number


def env_bool(
    name: str, default: bool, environ: Mapping[str, str] | None = None
) -> bool:
    """Return the variable as a boolean; unknown spellings are an error, not False."""
    value = _raw(name, environ)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise EnvError(f"{name} must be one of {sorted(_TRUE | _FALSE)}, got {value!r}")


def env_list(
    name: str, default: list[str], environ: Mapping[str, str] | None = None
) -> list[str]:
    """Return a comma-separated variable as a list of non-empty, stripped items."""
    value = _raw(name, environ)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def env_networks(
    name: str, default: list[str], environ: Mapping[str, str] | None = None
) -> list[str]:
    """Return a comma-separated list of networks (``10.0.0.0/8``, ``::1``: a bare
    address is one host), each written in its normal form.

    Raises:
        EnvError: an item is not an IPv4 or IPv6 network.
    """
    networks = []
    for item in env_list(name, default, environ):
        try:
            networks.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            raise EnvError(f"{name} must be networks (CIDR), got {item!r}") from None
    return networks


def env_pairs(name: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return ``a=x,b=y`` as ``{"a": "x", "b": "y"}`` (empty when unset).

    Raises:
        EnvError: an item is not ``key=value``, or a key appears twice.
    """
    pairs: dict[str, str] = {}
    for item in env_list(name, [], environ):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise EnvError(f"{name} must be key=value pairs, got {item!r}")
        if key in pairs:
            raise EnvError(f"{name} names {key!r} twice")
        pairs[key] = value
    return pairs


def env_float_pairs(
    name: str, *, minimum: float, environ: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Return ``a=1.5,b=2`` as ``{"a": 1.5, "b": 2.0}`` (empty when unset).

    Raises:
        EnvError: not ``key=number`` pairs, or a number below ``minimum``.
    """
    numbers: dict[str, float] = {}
    for key, value in env_pairs(name, environ).items():
        try:
            number = float(value)
        except ValueError:
            raise EnvError(f"{name}: {key}={value!r} is not a number") from None
        if not math.isfinite(number) or number < minimum:
            raise EnvError(f"{name}: {key} must be a number >= {minimum}, got {value}")
        numbers[key] = number
    return numbers


def env_secret(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Return a secret from ``NAME`` or from the file named by ``NAME_FILE``.

    A ``NAME_FILE`` that points at a missing or empty file is an error: a secret
    that silently disappears is worse than a process that refuses to start.
    """
    direct = _raw(name, environ)
    file_name = _raw(f"{name}_FILE", environ)
    if direct is not None and file_name is not None:
        raise EnvError(f"set {name} or {name}_FILE, not both")
    if direct is not None:
        return direct
    if file_name is None:
        return None
    path = Path(file_name)
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise EnvError(f"{name}_FILE={file_name} cannot be read: {exc}") from None
    if not secret:
        raise EnvError(f"{name}_FILE={file_name} is empty")
    return secret


def dead_peer_options(tcp_timeout_s: float) -> dict[str, int]:
    """libpq options that break a PostgreSQL connection to a silent peer in time.

    A database that is blackholed (a partition, a dead host) answers nothing:
    without these a connect waits for the kernel's SYN retries (about two minutes)
    and a query on an open connection for its retransmissions (about fifteen).
    Connects give up after half of ``tcp_timeout_s``, data unacknowledged for
    ``tcp_timeout_s`` breaks the connection (``tcp_user_timeout``), and keepalives
    find an idle dead peer as fast, so every caller (the node agent's pass, the
    gateway's snapshot refresh, the usage flush) learns within seconds that the
    database is gone and goes on from what it last knew.
    """
    half = max(1, round(tcp_timeout_s / 2))
    return {
        "connect_timeout": half,
        "keepalives": 1,
        "keepalives_idle": half,
        "keepalives_interval": max(1, round(tcp_timeout_s / 5)),
        "keepalives_count": 3,
        "tcp_user_timeout": round(tcp_timeout_s * 1000),
    }


def parse_database_url(
    url: str, *, base_dir: Path, tcp_timeout_s: float | None = None
) -> dict[str, Any]:
    """Turn ``sqlite:///path`` or ``postgresql://user:pw@host:port/name`` into DATABASES.

    A relative SQLite path is taken relative to ``base_dir``. Query parameters of a
    PostgreSQL URL become connection options (``?sslmode=require``), over
    ``dead_peer_options(tcp_timeout_s)`` when that is given.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        raw_path = unquote(parts.path)
        if parts.netloc:
            raise EnvError(
                "DATABASE_URL for SQLite has the form sqlite:///relative/path"
            )
        # sqlite:///db.sqlite3 -> "/db.sqlite3" (relative); sqlite:////abs -> "//abs"
        name = raw_path[1:] if raw_path.startswith("/") else raw_path
        if not name:
            raise EnvError("DATABASE_URL for SQLite must name a file")
        if name == ":memory:":
            return {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
        path = Path(name)
        if not path.is_absolute():
            path = base_dir / path
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}
    if scheme in {"postgres", "postgresql", "pgsql"}:
        name = unquote(parts.path.lstrip("/"))
        if not name:
            raise EnvError("DATABASE_URL for PostgreSQL must name a database")
        try:
            port = parts.port
        except ValueError as exc:
            raise EnvError(f"DATABASE_URL has an invalid port: {exc}") from None
        options: dict[str, Any] = {
            **(dead_peer_options(tcp_timeout_s) if tcp_timeout_s is not None else {}),
            **dict(parse_qsl(parts.query)),
        }
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(port or ""),
            "OPTIONS": options,
        }
    raise EnvError(
        f"DATABASE_URL scheme {scheme!r} is not supported (sqlite, postgresql)"
    )
