"""A throwaway PostgreSQL server that a drill or test may stop and start again.

Public surface: ``OwnPostgres``, ``find_pg_bin``.

The control-plane-down drills stop the platform's database; stopping the machine's
shared server would break everyone else's work, so they run their own: ``initdb``
into a temporary directory, on a free port of 127.0.0.1, trust authentication for
loopback only, thrown away on exit. The server refuses to run as root, so when
this process is root the binaries run as the ``postgres`` OS user (``runuser``)
and the directory is handed to that user.

    with OwnPostgres() as pg:
        pg.create_database("platform")
        env["DATABASE_URL"] = pg.url("platform")
        ...
        pg.stop()    # fast shutdown: open connections are cut
        pg.start()   # same data, same port
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from localrun.processes import free_port

__all__ = ["OwnPostgres", "find_pg_bin"]

_OS_USER = "postgres"


def find_pg_bin() -> Path:
    """Return the newest ``/usr/lib/postgresql/<major>/bin`` holding ``pg_ctl``.

    Raises FileNotFoundError when no server binaries are installed.
    """
    candidates = [
        Path(path).parent
        for path in glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")
        if os.access(path, os.X_OK)
    ]
    if not candidates:
        raise FileNotFoundError("no /usr/lib/postgresql/*/bin/pg_ctl installed")
    return max(
        candidates, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0
    )


class OwnPostgres:
    """A PostgreSQL server of our own in a temporary directory (a context manager).

    ``__enter__`` runs ``initdb`` and starts the server; ``__exit__`` stops it and
    deletes the directory. ``stop``/``start`` may be called any number of times in
    between; the port and the data survive them. ``url(dbname)`` is a
    ``DATABASE_URL`` for user ``postgres`` (no password: trust on loopback).
    ``host`` is the address it listens on (127.0.0.1 unless a fault drill puts it
    in a network namespace of its own) and ``command_prefix`` runs every server
    command under another (``ip netns exec NAME``, so the server lives there).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        start_timeout_s: int = 30,
        host: str = "127.0.0.1",
        command_prefix: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self.host = host
        self.command_prefix = tuple(command_prefix)
        self.bin = find_pg_bin()
        self._tmp: Path | None = None

    # -- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> OwnPostgres:
        self._tmp = Path(tempfile.mkdtemp(prefix="own-pg-"))
        try:
            self._chown(self._tmp)
            self._run(
                "initdb",
                "-D",
                str(self.data_dir),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            )
            # Loopback only, no Unix socket in a shared directory, and no fsync: the
            # data is thrown away with the directory, and no test crashes the
            # machine. Commits stay synchronous: a server stopped with ``-m
            # immediate`` (the fault suite's crash) loses the WAL still in its
            # buffers, and with asynchronous commits that was a limit the API had
            # acknowledged seconds before (with fsync off, the wait is a write).
            with (self.data_dir / "postgresql.conf").open("a") as conf:
                conf.write(
                    f"\nlisten_addresses = '{self.host}'\nport = {self.port}\n"
                    f"unix_socket_directories = '{self._tmp}'\n"
                    "fsync = off\nfull_page_writes = off\n"
                    "max_connections = 200\n"
                )
            if self.host != "127.0.0.1":
                # Trust the peers on the server's own subnet (the far end of a
                # namespace's veth pair); initdb trusts loopback only.
                with (self.data_dir / "pg_hba.conf").open("a") as hba:
                    hba.write("host all all samenet trust\n")
            self.start()
        except BaseException:
            self._cleanup()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._cleanup()

    def start(self) -> None:
        """Start the server and wait until it accepts connections (``pg_ctl -w``)."""
        self._run(
            "pg_ctl",
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_path),
            "-w",
            "-t",
            str(self.start_timeout_s),
            "start",
        )

    def stop(self, *, mode: str = "fast") -> None:
        """Stop the server: a fast shutdown (open sessions are disconnected), or
        ``mode="immediate"``, as a crash would (no checkpoint; recovery at start)."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop")

    @property
    def is_running(self) -> bool:
        """Return True if ``pg_ctl status`` finds the server running."""
        return (
            self._run(
                "pg_ctl", "-D", str(self.data_dir), "status", check=False
            ).returncode
            == 0
        )

    # -- use --------------------------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        """Return the ``DATABASE_URL`` of database ``dbname`` on this server."""
        return f"postgresql://postgres@{self.host}:{self.port}/{dbname}"

    def create_database(self, dbname: str) -> str:
        """Create database ``dbname``; return its URL."""
        self._run(
            "createdb",
            "-h",
            self.host,
            "-p",
            str(self.port),
            "-U",
            "postgres",
            dbname,
        )
        return self.url(dbname)

    @property
    def data_dir(self) -> Path:
        if self._tmp is None:
            raise RuntimeError("OwnPostgres is used outside its with block")
        return self._tmp / "data"

    @property
    def log_path(self) -> Path:
        """The server's log (``pg_ctl -l``), for a failing test to print."""
        if self._tmp is None:
            raise RuntimeError("OwnPostgres is used outside its with block")
        return self._tmp / "server.log"

    def log(self) -> str:
        """Return the server's log so far ('' before it started)."""
        path = self.log_path
        return path.read_text(errors="replace") if path.exists() else ""

    # -- internals --------------------------------------------------------------------

    def _as_os_user(self) -> bool:
        return os.geteuid() == 0

    def _chown(self, path: Path) -> None:
        if self._as_os_user():
            user = pwd.getpwnam(_OS_USER)
            os.chown(path, user.pw_uid, user.pw_gid)
            path.chmod(0o700)

    def _run(
        self, program: str, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bin / program), *args]
        if self._as_os_user():
            argv = ["runuser", "-u", _OS_USER, "--", *argv]
        argv = [*self.command_prefix, *argv]
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            check=False,
            # initdb and pg_ctl read no DB settings from us; a clean environment keeps
            # PGPORT/PGHOST of the caller from pointing them elsewhere.
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"},
            cwd="/",
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{program} failed ({result.returncode}): "
                f"{result.stderr.strip() or result.stdout.strip()}"
            )
        return result

    def _cleanup(self) -> None:
        if self._tmp is None:
            return
        if (self.data_dir / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError):
                self._run(
                    "pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "stop"
                )
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp = None
