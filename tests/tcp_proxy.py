"""A loopback TCP proxy that a test can cut, to make a server unreachable.

The platform's processes (gateway, node agent, simulated replica, real vLLM) are
started with ``localrun.processes`` and ``localrun.vllm_cpu``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from localrun.processes import free_port

__all__ = ["TcpProxy"]


class TcpProxy:
    """A loopback TCP forwarder that a test can cut, to make a server unreachable.

    Runs its own event loop in a thread; ``cut()`` closes the listener and every
    open connection, as a database host going away would, and ``resume()`` listens
    again on the same port. With ``listening=False`` it starts cut: the port is
    taken for it, but connections are refused until ``resume()``.
    """

    def __init__(
        self, target_host: str, target_port: int, *, listening: bool = True
    ) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready, listening), daemon=True
        )
        self._thread.start()
        if not ready.wait(10):
            raise AssertionError("proxy did not start")

    def _run(self, ready: threading.Event, listening: bool) -> None:
        async def pipe(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            try:
                while chunk := await reader.read(65536):
                    writer.write(chunk)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def handle(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                writer.close()
                return
            self._writers.update({writer, up_writer})
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        async def listen() -> None:
            self._server = await asyncio.start_server(handle, "127.0.0.1", self.port)

        self._listen = listen
        if listening:
            self._loop.run_until_complete(listen())
        ready.set()
        self._loop.run_forever()

    def resume(self) -> None:
        """Accept connections again (on the same port)."""
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(5)

    def cut(self) -> None:
        """Refuse new connections and drop the open ones."""

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)

    def stop(self) -> None:
        """Close the proxy and end its thread."""
        with contextlib.suppress(Exception):
            self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
