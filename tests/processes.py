"""Test-only process helpers: a simulated replica per test, a TCP proxy to cut.

The shared helpers live in ``drills.launch`` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from drills.launch import (
    ROOT,
    Process,
    free_port,
    is_healthy,
    start_gateway,
    wait_until,
)

__all__ = [
    "ROOT",
    "Process",
    "TcpProxy",
    "free_port",
    "is_healthy",
    "sim_replica",
    "start_gateway",
    "wait_until",
]


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
