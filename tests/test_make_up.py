"""`make up` as a user runs it: on a terminal, secrets generated, Ctrl-C to stop.

The test gives `make up` a terminal of its own (a pty it controls, with a shell as
its session leader, as in a terminal window), its own folder
for logs, pid files and credentials (``PLATFORM_LOCAL_DIR``), ports, the test
database and a Redis prefix, so it runs beside a developer's `make up`. It reads
the banner, probes what the issue found open (``/metrics``, a replica's ``/v1`` and
``/sim/faults``), checks that no secret is in the process list, then types Ctrl-C.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import termios
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from django.core.management import call_command
from django.db import connection

from localrun.processes import ROOT, database_url, free_port, wait_until
from tests.live import process_cmdlines

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BANNER_END = b"Ctrl-C stops the server"
SECRETS = ("engine_api_key", "sim_admin_token", "metrics_token")


@dataclass
class Terminal:
    """A process tree run on a pty, as on a user's terminal."""

    popen: subprocess.Popen[bytes]
    master: int
    output: bytearray = field(default_factory=bytearray)

    def read_until(self, marker: bytes, timeout_s: float) -> bool:
        """Read output until ``marker`` shows, the process exits or time is up."""
        deadline = time.monotonic() + timeout_s
        while marker not in self.output and time.monotonic() < deadline:
            if not self._read(0.2) and self.popen.poll() is not None:
                return marker in self.output
        return marker in self.output

    def read_to_exit(self, timeout_s: float) -> int:
        """Read output until the process exits; return its status."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._read(0.2) and self.popen.poll() is not None:
                return self.popen.returncode
        raise AssertionError(f"still running after {timeout_s} s:\n{self.text()}")

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def hang_up(self) -> None:
        """Close the terminal, as closing its window does."""
        if self.master >= 0:
            os.close(self.master)
            self.master = -1

    def text(self) -> str:
        return self.output.decode(errors="replace")

    def _read(self, wait_s: float) -> bool:
        if self.master < 0:
            return False
        ready, _, _ = select.select([self.master], [], [], wait_s)
        if not ready:
            return False
        try:
            data = os.read(self.master, 65536)
        except OSError:  # the other side closed: everything has exited
            return False
        self.output += data
        return bool(data)


def _take_terminal() -> None:
    # In the child: a session of its own, with the pty as its controlling terminal,
    # and Ctrl-C's signals as a terminal's shell has them. A suite started in the
    # background of a shell without job control inherits SIGINT ignored, and a
    # script cannot trap a signal ignored when it started.
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # A shell on a terminal starts with every signal at its default and none
    # blocked; a test worker may have some ignored or blocked (inherited across
    # exec), and a script cannot trap a signal ignored when it started.
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


@contextlib.contextmanager
def on_a_terminal(argv: list[str], env: dict[str, str]) -> Iterator[Terminal]:
    master, slave = pty.openpty()
    popen = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        preexec_fn=_take_terminal,
    )
    os.close(slave)
    terminal = Terminal(popen=popen, master=master)
    try:
        yield terminal
    finally:
        # Closing the terminal hangs it up: the shell dies, the kernel sends SIGHUP
        # to the terminal's foreground job, and up.sh stops everything.
        terminal.hang_up()
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(60)


def platform_processes(local: Path, banner: str) -> tuple[list[int], list[int]]:
    """Return the pids `make up` started (server, worker, gates worker, batches
    worker, agent), and the replica ports."""
    pids = [int(p.read_text()) for p in (local / "run").glob("*.pid")]
    ports = [int(m) for m in re.findall(r"serving\s+http://127\.0\.0\.1:(\d+)", banner)]
    assert len(pids) == 5, pids
    assert len(ports) == 3, banner
    return pids, ports


def assert_all_stopped(local: Path, pids: list[int], ports: list[int]) -> None:
    """Wait for up.sh's stop to finish (its last step removes the pid files)."""
    try:
        wait_until(
            lambda: (
                not list((local / "run").glob("*.pid"))
                and not any(is_running(pid) for pid in pids)
            ),
            timeout_s=60,
            message="the server, the workers and the agent to be gone",
        )
    except AssertionError as exc:
        left = {pid: _cmdline(pid) for pid in pids if is_running(pid)}
        files = sorted(p.name for p in (local / "run").glob("*.pid"))
        up = [line for line in process_cmdlines().split(b"\n") if b"up.sh" in line]
        hup = signal.getsignal(signal.SIGHUP)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        raise AssertionError(
            f"{exc}: still running {left}; pid files {files}; up.sh: {up}; "
            f"this worker's SIGHUP {hup}, blocked {blocked}"
        ) from None
    assert not any(is_listening(port) for port in ports)


MAKE_UP = ["bash", "-c", "make -o .venv/.installed up; exit $?"]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def is_listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def make_up_env(
    django_db_setup: None, django_db_blocker: DjangoDbBlocker, tmp_path: Path
) -> Iterator[dict[str, str]]:
    """Return the environment of a `make up` on the test database; flush after."""
    name = str(connection.settings_dict["NAME"])
    test_name = connection.settings_dict.get("TEST", {}).get("NAME")
    if not (name.startswith("test_") or name == test_name):
        raise RuntimeError(f"refusing to run make up against {name}")
    port = free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PLATFORM_", "SECRET_KEY", "DJANGO_", "MAKE"))
    }
    env.update(
        DATABASE_URL=database_url(),
        PLATFORM_LOCAL_DIR=str(tmp_path / "local"),
        PLATFORM_PORT=str(port),
        PLATFORM_REPLICA_PORTS=f"{port + 1}-{port + 60}",
        PLATFORM_REDIS_PREFIX=f"make-up-{uuid.uuid4().hex[:8]}",
        PLATFORM_REGION="make-up",
        TERM="dumb",
    )
    with django_db_blocker.unblock():
        try:
            yield env
        finally:
            # Should the test fail before its Ctrl-C: what is still up, stopped
            # (the agent stops its replicas on SIGTERM).
            for pidfile in (tmp_path / "local" / "run").glob("*.pid"):
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pidfile.read_text()), signal.SIGTERM)
            call_command("flush", interactive=False, verbosity=0)


def test_make_up_runs_with_its_secrets_and_ctrl_c_stops_it_cleanly(
    make_up_env: dict[str, str],
) -> None:
    local = Path(make_up_env["PLATFORM_LOCAL_DIR"])
    base = f"http://127.0.0.1:{make_up_env['PLATFORM_PORT']}"
    with on_a_terminal(MAKE_UP, make_up_env) as term:
        assert term.read_until(BANNER_END, timeout_s=240), term.text()
        banner = term.text()
        creds_path = local / "credentials.json"
        assert creds_path.stat().st_mode & 0o777 == 0o600
        creds = json.loads(creds_path.read_text())
        assert all(len(creds[name]) >= 32 for name in SECRETS)
        assert f"Metrics token  {creds['metrics_token']}" in banner
        # What it runs on: the test database, and Redis or the in-memory stand-ins.
        assert "database  PostgreSQL" in banner or "database  SQLite" in banner
        if make_up_env.get("REDIS_URL"):
            assert "limits    Redis" in banner, banner
        else:
            assert "limits    in the gateway's memory" in banner, banner

        scrape = {"Authorization": f"Bearer {creds['metrics_token']}"}
        assert httpx.get(f"{base}/metrics").status_code == 401
        assert 'team="demo"' in httpx.get(f"{base}/metrics", headers=scrape).text

        replica = re.search(r"chat-7b\s+serving\s+(http://\S+)", banner)
        assert replica is not None, banner
        url = replica.group(1)
        chat = {
            "model": "chat-7b",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        }
        assert httpx.post(f"{url}/v1/chat/completions", json=chat).status_code == 401
        assert httpx.post(f"{url}/sim/faults", json={}).status_code == 401
        admin = {"Authorization": f"Bearer {creds['sim_admin_token']}"}
        assert httpx.post(f"{url}/sim/faults", json={}, headers=admin).is_success

        cmdlines = process_cmdlines()
        for name in (
            *SECRETS,
            "team_key",
            "admin_token",
            "console_password",
            "finance_password",
        ):
            assert creds[name].encode() not in cmdlines, name

        pids, replica_ports = platform_processes(local, banner)
        term.type(b"\x03")  # Ctrl-C
        status = term.read_to_exit(timeout_s=90)
        after = term.text().split(BANNER_END.decode(), 1)[1]

    assert status == 0, after
    assert "stopped." in after
    assert "a platform process exited" not in after
    assert "make: ***" not in after
    assert_all_stopped(local, pids, replica_ports)


def test_make_up_stops_everything_when_its_terminal_closes(
    make_up_env: dict[str, str],
) -> None:
    """A closed terminal window hangs up its shell, whose death hangs up the job
    that holds the terminal: up.sh, in the process group `bash -m` gave it."""
    local = Path(make_up_env["PLATFORM_LOCAL_DIR"])
    with on_a_terminal(MAKE_UP, make_up_env) as term:
        assert term.read_until(BANNER_END, timeout_s=240), term.text()
        pids, replica_ports = platform_processes(local, term.text())
        term.hang_up()
    assert_all_stopped(local, pids, replica_ports)


def test_make_up_in_the_background_leaves_nothing_when_its_wrapper_kills_it(
    make_up_env: dict[str, str], tmp_path: Path
) -> None:
    """GIVEN `make up` started as a background job of a script (so make and its
    recipe inherit SIGINT ignored), output to a file
    WHEN a wrapper sends make SIGINT and then, as wrappers do, SIGKILL
    THEN every process it started stops: the server, the workers, the agent and
    its replicas (issue 32 found them all orphaned, serving on); one that cannot
    finish (here the worker, stopped) is killed after the stop's grace, by name.
    """
    local = Path(make_up_env["PLATFORM_LOCAL_DIR"])
    make_up_env = {**make_up_env, "PLATFORM_UP_STOP_GRACE_S": "3"}
    log = tmp_path / "make-up.log"
    script = f"make -o .venv/.installed up >{log} 2>&1 & echo $!; wait"
    wrapper = subprocess.Popen(
        ["bash", "-c", script],
        cwd=ROOT,
        env=make_up_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert wrapper.stdout is not None
        make_pid = int(wrapper.stdout.readline())
        wait_until(
            lambda: log.exists() and BANNER_END in log.read_bytes(),
            timeout_s=240,
            interval_s=0.5,
            message="make up's banner",
        )
        banner = log.read_text()
        # The test database: PostgreSQL, or SQLite without DATABASE_URL.
        assert "database  PostgreSQL" in banner or "database  SQLite" in banner
        pids, replica_ports = platform_processes(local, banner)
        # A worker that cannot answer SIGTERM (stopped: the signal stays pending).
        worker = int((local / "run" / "worker.pid").read_text())
        os.kill(worker, signal.SIGSTOP)
        os.kill(make_pid, signal.SIGINT)
        os.kill(make_pid, signal.SIGKILL)
        assert_all_stopped(local, pids, replica_ports)
        assert not is_listening(int(make_up_env["PLATFORM_PORT"]))
        said = f"worker (pid {worker}) did not stop within 3 s; killing it"
        assert said in log.read_text(), log.read_text()[-2000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(wrapper.pid, signal.SIGKILL)
        wrapper.wait(10)


def test_make_up_refuses_to_start_on_a_taken_port(
    make_up_env: dict[str, str],
) -> None:
    """With its port taken, up.sh says which and by what, exits 1 and starts
    nothing (before, it printed credentials that did not work, then failed)."""
    local = Path(make_up_env["PLATFORM_LOCAL_DIR"])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", int(make_up_env["PLATFORM_PORT"])))
        holder.listen()
        done = subprocess.run(
            ["bash", "platform/local/up.sh"],
            cwd=ROOT,
            env=make_up_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 1, done.stderr
    assert f"port {make_up_env['PLATFORM_PORT']} on 127.0.0.1 is taken" in done.stderr
    assert "Serving platform is up" not in done.stdout
    assert not list((local / "run").glob("*.pid"))
    assert not (local / "logs" / "server.log").exists()
