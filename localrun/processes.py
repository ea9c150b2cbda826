"""Start the platform's processes on this machine and wait on them.

Public surface: ``ROOT``, ``wait_until``, ``free_port``, ``Process``, ``spawn``,
``server_pgid``, ``is_healthy``, ``database_url``, ``drill_env``, ``SERVERS``, ``gateway_argv``,
``start_gateway``, ``agent_argv``, ``start_agent``, ``sim_replica``, ``serving_replicas``,
``manage``, ``bootstrap_platform``.

The gateway (an ASGI server on the ASGI app: uvicorn, daphne or granian), the
node agent (``manage.py engine_agent``) and one simulated replica
(``python -m simengine``), each in its own session so that stopping it
stops its children. Used by the live drills (``manage.py isolation_test``), the
benchmarks and the end-to-end tests; real vLLM is ``localrun.vllm_cpu``.
Nothing here sleeps a fixed time to wait for something: ``wait_until`` polls a
condition against a deadline and fails with a message when the deadline passes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def wait_until(
    condition: Callable[[], T | None],
    *,
    timeout_s: float = 15.0,
    interval_s: float = 0.02,
    message: str = "condition",
) -> T:
    """Return the first truthy value of ``condition()``; fail after ``timeout_s``.

    ``condition`` may return None while it waits (a row not there yet): the value
    returned is never None, so callers need not check it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {message}")
        # A short pause between polls, not a wait for the condition itself.
        time.sleep(interval_s)


def free_port() -> int:
    """Return a TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Process:
    """A running child process and the URL it serves."""

    popen: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return (
            self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        )

    def stop(self, *, grace_s: float = 5.0) -> int:
        """Stop the process group; return the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(grace_s)
        return int(self.popen.returncode)


def server_pgid(url: str, *, argv_has: bytes = b"") -> int:
    """Return the process group leader whose command line names ``url``'s port.

    With ``argv_has``, its command line must also hold that word (``b"serve"`` for
    ``vllm serve``). Raises LookupError when there is none.
    """
    port = url.rsplit(":", 1)[1].encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            pid = int(entry.name)
            if (
                port in argv
                and (not argv_has or argv_has in argv)
                and os.getpgid(pid) == pid
            ):
                return pid
        except OSError:
            continue
    raise LookupError(f"no process group leader serves port {port.decode()}")


def is_healthy(url: str) -> bool:
    """Return True if ``GET url/health`` answers 200."""
    try:
        return httpx.get(f"{url}/health", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def database_url() -> str:
    """Return a URL for the test database that other processes can open."""
    from django.db import connection

    settings = connection.settings_dict
    if settings["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{Path(settings['NAME']).resolve()}"
    user = settings.get("USER") or ""
    password = f":{settings['PASSWORD']}" if settings.get("PASSWORD") else ""
    host = settings.get("HOST") or "127.0.0.1"
    port = f":{settings['PORT']}" if settings.get("PORT") else ""
    return f"postgresql://{user}{password}@{host}{port}/{settings['NAME']}"


def drill_env(*, region: str, prefix: str, **overrides: str) -> dict[str, str]:
    """Return the environment of a live drill's gateway and agent: this process's
    environment, database and ``SECRET_KEY``, ``region`` under its own Redis
    ``prefix``, a 0.5 s snapshot refresh and no default token limit; then
    ``overrides`` (settings' names). Without ``DJANGO_SETTINGS_MODULE``: each
    process picks its own."""
    from django.conf import settings

    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "PLATFORM_REGION": region,
        "PLATFORM_REDIS_PREFIX": prefix,
        "PLATFORM_SNAPSHOT_REFRESH_S": "0.5",
        "PLATFORM_DEFAULT_TOKENS_PER_MINUTE": "0",
        "SECRET_KEY": settings.SECRET_KEY,
        **overrides,
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def spawn(argv: list[str], env: dict[str, str], log_path: Path, url: str) -> Process:
    """Start a platform process in its own session, logging to ``log_path``."""
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Process(popen=popen, url=url, log_path=log_path)


SERVERS = ("uvicorn", "daphne", "granian")
_APP = "config.asgi:application"
_HTTP_PROTOCOL = "config.http_protocol:GatewayHttpProtocol"


def gateway_argv(
    port: int,
    *,
    workers: int = 1,
    server: str | None = None,
    host: str = "127.0.0.1",
    log_level: Literal["warning", "info"] = "warning",
) -> list[str]:
    """Return the command line of a gateway process: an ASGI server on the app.

    ``server`` is one of ``SERVERS``; None reads ``PLATFORM_SERVER`` (default
    uvicorn), so ``make up``, the end-to-end tests and the benchmarks start the
    server one setting names (docs/configuration.md, ``PLATFORM_SERVER``).
    uvicorn and daphne are supported servers; granian is a benchmark lever only
    (a dev dependency). None writes an access log.

    daphne sends no ASGI lifespan events, so the gateway starts its loops on its
    first request and never runs ``Gateway.stop`` (no last usage or key-use
    flush, no leaving the region's live load). It has no ``--workers``: more than
    one worker under daphne is a ValueError rather than a silent single process.
    """
    name = server if server is not None else os.environ.get("PLATFORM_SERVER")
    name = name or "uvicorn"
    if name not in SERVERS:
        raise ValueError(
            f"unknown gateway server {name!r}: PLATFORM_SERVER is one of "
            f"{', '.join(SERVERS)}"
        )
    if workers < 1:
        raise ValueError(f"a gateway needs at least one worker, not {workers}")
    python = [sys.executable, "-m", name]
    if name == "daphne":
        if workers > 1:
            raise ValueError(
                f"daphne has no --workers and runs one process: it cannot run "
                f"{workers} gateway workers (run uvicorn, or one daphne per port)"
            )
        # Verbosity 0 logs warnings; from 1 (info) daphne writes an access log to
        # stdout unless --access-log names a file.
        level = (
            ["-v", "0"]
            if log_level == "warning"
            else ["-v", "1", "--access-log", os.devnull]
        )
        return [*python, "-b", host, "-p", str(port), *level, _APP]
    if name == "granian":
        # The asgi interface sends lifespan events (asginl would not); the loop is
        # uvicorn's, so the two compare servers rather than event loops.
        return [
            *python, "--interface", "asgi", "--host", host, "--port", str(port),
            "--workers", str(workers), "--loop", "uvloop",
            "--no-access-log", "--log-level", log_level, _APP,
        ]  # fmt: skip
    # uvicorn's httptools protocol, plus the gateway's chunk-frame writes
    # (config.http_protocol).
    argv = [
        *python, _APP, "--host", host, "--port", str(port), "--lifespan", "on",
        "--no-access-log", "--log-level", log_level, "--http", _HTTP_PROTOCOL,
    ]  # fmt: skip
    if workers > 1:
        argv += ["--workers", str(workers)]
    return argv


def start_gateway(
    env: dict[str, str],
    tmp: Path,
    name: str = "gateway",
    *,
    wait_for_snapshot: bool = True,
    port: int | None = None,
    server: str | None = None,
) -> Process:
    """Start a gateway process and wait until it has a snapshot.

    With ``wait_for_snapshot=False``, wait only until it answers ``/healthz`` at all
    (a gateway started with the control plane down answers 503 there). ``port``:
    a restarted gateway takes its old one (a load balancer points there).
    ``server``: the ASGI server, as ``gateway_argv`` takes it.

    A port from ``free_port()`` is free only when asked: another process (a test
    beside this one, a node agent's replica) can take it before the gateway
    binds. Only a gateway of this region counts as an answer, and a gateway
    that exits because its port was taken is started again on another port
    (not when ``port`` was given: that one is wanted).
    """
    for _ in range(_PORT_TRIES):
        process = _spawn_gateway(
            env,
            tmp,
            name,
            port or free_port(),
            server=server,
            wait_for_snapshot=wait_for_snapshot,
        )
        if process.popen.poll() is None:
            return process
        if port is not None or "address already in use" not in process.log().lower():
            break
    raise AssertionError(f"{name} exited:\n{process.log()}")


_PORT_TRIES = 3


def _spawn_gateway(
    env: dict[str, str],
    tmp: Path,
    name: str,
    port: int,
    *,
    server: str | None,
    wait_for_snapshot: bool,
) -> Process:
    """Start one gateway on ``port``; return once it answers or has exited."""
    process = spawn(
        gateway_argv(port, server=server),
        env,
        tmp / f"{name}-{port}.log",
        f"http://127.0.0.1:{port}",
    )
    region = env.get("PLATFORM_REGION", "local")
    wait_until(
        lambda: (
            _healthz(process, region, any_status=not wait_for_snapshot)
            or process.popen.poll() is not None
        ),
        timeout_s=60,
        message=f"{name} to load its snapshot" if wait_for_snapshot else name,
    )
    return process


def _healthz(process: Process, region: str, *, any_status: bool = False) -> bool:
    """Whether a gateway of ``region`` answers ``/healthz`` (``any_status``) or
    has a snapshot.

    A gateway with a snapshot may still answer 503 (its region has no serving
    replica yet): ``snapshot`` in the body says whether it loaded one. An answer
    that is not a gateway's health of ``region`` is another server's on the port.
    """
    try:
        response = httpx.get(f"{process.url}/healthz", timeout=1)
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return False
    if not isinstance(body, dict) or body.get("region") != region:
        return False
    if any_status or response.status_code == 200:
        return True
    return body.get("snapshot") not in (None, "none")


def agent_argv(
    tmp: Path, *, region: str, node: str = "drill-node", gpus: int = 16
) -> list[str]:
    """Return the command line of a node agent for ``region``'s pools, its
    replicas on 61 ports from a free one and their logs under ``tmp/replicas``."""
    first = free_port()
    return [
        sys.executable,
        "manage.py",
        "engine_agent",
        "--node",
        node,
        "--region",
        region,
        "--gpus",
        str(gpus),
        "--ports",
        f"{first}-{first + 60}",
        "--log-dir",
        str(tmp / "replicas"),
    ]


def start_agent(
    env: dict[str, str],
    tmp: Path,
    *,
    region: str,
    node: str = "drill-node",
    gpus: int = 16,
) -> Process:
    """Start a node agent that runs simulated replicas for ``region``'s pools."""
    return spawn(
        agent_argv(tmp, region=region, node=node, gpus=gpus),
        env,
        tmp / f"agent-{node}.log",
        "",
    )


@contextlib.contextmanager
def sim_replica(
    log_dir: Path, *flags: str, model: str = "chat-7b", wait_healthy: bool = True
) -> Iterator[Process]:
    """Run ``python -m simengine`` on a free port while the block runs.

    Yields once ``/health`` answers 200 (once the port listens, with
    ``wait_healthy=False``, for a replica told to warm up slowly); stops it on exit.
    """
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "simengine",
        "--model",
        model,
        "--served-model-name",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
    ]
    process = spawn(
        argv, dict(os.environ), log_dir / f"sim-{port}.log", f"http://127.0.0.1:{port}"
    )
    popen = process.popen
    try:
        if wait_healthy:
            wait_until(
                lambda: is_healthy(process.url) or popen.poll() is not None,
                timeout_s=30,
                message=f"sim replica on {port}",
            )
            if popen.poll() is not None:
                raise AssertionError(f"sim replica exited:\n{process.log()}")
        else:
            wait_until(
                lambda: _is_listening(port) or popen.poll() is not None,
                timeout_s=30,
                message=f"sim replica listening on {port}",
            )
        yield process
    finally:
        process.stop()


def _is_listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def serving_replicas(region: str) -> int:
    """Return how many replicas of ``region`` are serving (database view)."""
    from engine_nodes.models import Replica

    return Replica.objects.filter(region=region, state="serving").count()


def manage(env: dict[str, str], *args: str, timeout_s: float = 180) -> str:
    """Run ``manage.py ARGS`` with ``env``; return its stdout.

    Raises:
        RuntimeError: it exited with an error (the end of its stderr says why).
    """
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout_s,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"manage.py {args[0] if args else ''} failed: {result.stderr[-3000:]}"
        )
    return result.stdout


def bootstrap_platform(env: dict[str, str], credentials: Path) -> dict[str, Any]:
    """Migrate ``env``'s database and bootstrap the demo team and the secrets
    (``bootstrap_local``, which writes them to ``credentials``); put the secrets
    the processes need into ``env`` (never on a command line); return them all."""
    manage(env, "migrate", "--noinput")
    creds: dict[str, Any] = json.loads(
        manage(env, "bootstrap_local", "--json", "--credentials", str(credentials))
    )
    env["PLATFORM_ENGINE_API_KEY"] = creds["engine_api_key"]
    env["PLATFORM_SIM_ADMIN_TOKEN"] = creds["sim_admin_token"]
    env["PLATFORM_METRICS_TOKEN"] = creds["metrics_token"]
    return creds
