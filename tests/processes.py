"""Start real platform processes for end-to-end tests, and wait on conditions.

Nothing here sleeps a fixed time to wait for something: ``wait_until`` polls a
condition against a deadline and fails with a message when the deadline passes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    *,
    timeout_s: float = 15.0,
    interval_s: float = 0.02,
    message: str = "condition",
) -> T:
    """Return the first truthy value of ``condition()``; fail after ``timeout_s``."""
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


def is_healthy(url: str) -> bool:
    """Return True if ``GET url/health`` answers 200."""
    try:
        return httpx.get(f"{url}/health", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def sim_replica(
    tmp_path: Path, *flags: str, model: str = "chat-7b", wait_healthy: bool = True
) -> Iterator[Process]:
    """Run ``python -m engine_nodes.sim`` on a free port for the duration of a test."""
    port = free_port()
    log_path = tmp_path / f"sim-{port}.log"
    argv = [
        sys.executable,
        "-m",
        "engine_nodes.sim",
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
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    process = Process(popen=popen, url=f"http://127.0.0.1:{port}", log_path=log_path)
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
                lambda: _listening(port) or popen.poll() is not None,
                timeout_s=30,
                message=f"sim replica listening on {port}",
            )
        yield process
    finally:
        process.stop()


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class TcpProxy:
    """A loopback TCP forwarder that a test can cut, to make a server unreachable.

    Runs its own event loop in a thread; ``cut()`` closes the listener and every
    open connection, as a database host going away would.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        import asyncio
        import threading

        self.target = (target_host, target_port)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._writers: set = set()
        self._server = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise AssertionError("proxy did not start")

    def _run(self, ready) -> None:  # type: ignore[no-untyped-def]
        import asyncio

        async def pipe(reader, writer) -> None:  # type: ignore[no-untyped-def]
            try:
                while chunk := await reader.read(65536):
                    writer.write(chunk)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def handle(reader, writer) -> None:  # type: ignore[no-untyped-def]
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                writer.close()
                return
            self._writers.update({writer, up_writer})
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        async def start() -> None:
            self._server = await asyncio.start_server(handle, "127.0.0.1", self.port)
            ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def cut(self) -> None:
        """Refuse new connections and drop the open ones."""
        import asyncio

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
