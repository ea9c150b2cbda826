"""What ``make up`` checks before it starts anything, and says about what it runs on.

Public surface: ``taken_ports``, ``backends``; ``python -m localrun.up_checks``.

``python -m localrun.up_checks ports HOST PORT...`` prints one line per port that
cannot be bound on HOST (with what holds it, where ``ss`` can tell) and exits 1,
or exits 0 when every port is free. ``python -m localrun.up_checks backends``
prints the database, broker and limiter the platform will run on, from the same
environment variables the settings read, without any password.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from urllib.parse import urlsplit, urlunsplit

__all__ = ["backends", "taken_ports"]


def taken_ports(host: str, ports: list[int]) -> list[str]:
    """Return a line for each of ``ports`` that cannot be bound on ``host``."""
    lines = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                holder = _holder(port)
                lines.append(
                    f"port {port} on {host} is taken ({exc.strerror})"
                    + (f" by {holder}" if holder else "")
                )
    return lines


def _holder(port: int) -> str:
    """What listens on ``port``, as ``ss`` names it ("" if it cannot tell)."""
    ss = shutil.which("ss")
    if ss is None:
        return ""
    try:
        out = subprocess.run(
            [ss, "-ltnpH", f"sport = :{port}"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    for line in out.splitlines():
        if "users:" in line:
            return line.split("users:", 1)[1].strip()
    return ""


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def backends(environ: dict[str, str] | None = None) -> list[str]:
    """Return the banner's lines on the database, the broker and the limiter."""
    env = os.environ if environ is None else environ
    database = env.get("DATABASE_URL", "")
    redis_url = env.get("REDIS_URL", "")
    if database.startswith(("postgres://", "postgresql://", "pgsql://")):
        db_line = f"database  PostgreSQL {_without_password(database)}"
    else:
        path = database or "sqlite:///.local/platform.sqlite3"
        db_line = (
            f"database  SQLite {path.removeprefix('sqlite:///')} "
            "(no DATABASE_URL: for trying it out, not for teams)"
        )
    if redis_url:
        where = _without_password(redis_url)
        broker = f"broker    Redis {where} (Celery)"
        limiter = (
            f"limits    Redis {where}: team limits, live load and usage counts "
            "shared by the gateway processes"
        )
    else:
        broker = "broker    a folder under .local/ (no REDIS_URL; Celery's filesystem)"
        limiter = (
            "limits    in the gateway's memory (no REDIS_URL): one gateway process, "
            "usage flushed from it"
        )
    return [db_line, broker, limiter]


def main(argv: list[str]) -> int:
    if argv[:1] == ["backends"]:
        sys.stdout.write("\n".join(backends()) + "\n")
        return 0
    if argv[:1] == ["ports"] and len(argv) >= 3:
        taken = taken_ports(argv[1], [int(p) for p in argv[2:]])
        sys.stdout.write("".join(f"{line}\n" for line in taken))
        return 1 if taken else 0
    sys.stderr.write(
        "usage: python -m localrun.up_checks backends | ports HOST PORT...\n"
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
