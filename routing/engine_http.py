"""The gateway's HTTP/1.1 client for an engine's token stream: push, not pull.

Public surface: ``EngineClient``, ``EngineResponse``, ``Sink``.

aiohttp delivers a stream by waking the reading task once per chunk: a future, a
task step and the coroutine chain resumed, for every token of every stream. Here
the connection is an ``asyncio.Protocol`` with httptools' response parser, and
once the relay has seen the first token it hands the connection a ``Sink``: each
read from the socket (its de-chunked body, the pieces of one read joined, so one
write per read) goes to the sink from ``data_received`` itself, and the relay's
task sleeps until the sink declines something (the usage chunk, ``[DONE]``, a cut
event, an error) or the stream ends. What the sink declines, and everything
before it is set, is read with ``readany`` as before.

Connections are kept alive per replica (``keepalive_s``, below uvicorn's 5 s idle
close, as vLLM serves with uvicorn) and reused last-in first-out. A request whose
reused connection the server had closed just before (no byte of an answer came)
is sent once more on a new connection: the server never saw it.

Timeouts: connecting has ``connect_timeout_s``; a silent replica fails the read
after ``first_token_timeout_s`` until ``expect_tokens``, then after
``inter_token_timeout_s``, checked by one sweep of the open streams every
fraction of the shortest timeout instead of a timer re-armed on every read. A
stream whose reading is paused (the client reads slowly) is not timed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

from routing.domain.stall import ReplicaStalled, WaitingStream, stalled_replicas

__all__ = [
    "EngineClient",
    "EngineResponse",
    "FramedSink",
    "ReplicaStalled",
    "Sink",
    "chunk_data",
]

# A sink takes one read's body bytes and returns True when it consumed them;
# False leaves them for ``readany``.
Sink = Callable[[bytes], bool]
# A framed sink takes a read that is whole chunks as it came (frames) and their
# data (body); False: the read goes through the parser and to the ``Sink``.
FramedSink = Callable[[bytes, bytes], bool]

_MAX_BODY_BYTES = 8 * 1024 * 1024  # an error body or a whole answer, read whole
_PULL_HIGH_WATER = 256 * 1024  # unread bytes before the socket stops being read


class EngineResponse(asyncio.Protocol):
    """One connection to a replica, and the response it is reading.

    Made by ``EngineClient.post``; it answers ``status`` and ``headers`` once the
    head arrived, then streams the body (``readany``, ``read``, ``stream_to``) and
    goes back to the pool with ``release`` (read to its end) or is closed with
    ``close``.
    """

    def __init__(self, client: EngineClient, key: tuple[str, int]) -> None:
        self._client = client
        self.key = key
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._pieces: list[bytes] = []
        self._buffer: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Sink | None = None
        self._framed: FramedSink | None = None
        # The parser ended its last read at the end of a chunk: the next read,
        # if it is whole chunks, may skip it (``chunk_data``).
        self._chunk_closed = False
        self._at_boundary = False
        self._error: BaseException | None = None
        self._complete = False
        self._keep_alive = False
        self._got_bytes = False
        self._paused = 0  # reasons reading is paused: a slow client, a full buffer
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.idle_since = 0.0
        self.reused = False
        self.read_timeout_s = client.first_token_timeout_s
        self.last_read_at = 0.0
        # For the stall rule (``routing.domain.stall``): when the request went, when
        # a byte of answer last came, whether the answer has begun.
        self.sent_at = 0.0
        self.answered_at: float | None = None
        self.has_first_token = False
        # An answer that comes whole (embeddings): never failed by the stall rule.
        self.answers_whole = False

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.last_read_at = time.monotonic()
        self._got_bytes = True
        framed = self._framed
        if (
            framed is not None
            and self._at_boundary
            and not self._buffer
            and (body := chunk_data(data)) is not None
            and framed(data, body)
        ):
            return  # whole chunks, sent on as they came; the parser is between chunks
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ConnectionError("the replica upgraded the connection"))
            return
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"the replica's answer is not HTTP: {exc}"))
            return
        self._at_boundary = self._chunk_closed and data.endswith(b"\r\n")
        pieces = self._pieces
        if pieces:
            chunk = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces.clear()
            sink = self._sink
            if sink is None or self._buffer or not sink(chunk):
                self._buffer.append(chunk)
                self._buffered += len(chunk)
                if self._buffered > _PULL_HIGH_WATER:
                    self.pause_reading()
                self._wake()
        if self._complete:
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self._client.forget(self)
        if not self._complete and self._error is None:
            self._error = ConnectionResetError("the replica closed the connection")
        self.transport = None
        if self._head is not None and not self._head.done():
            self._head.set_exception(self._error or ConnectionResetError())
        self._wake()

    # -- httptools callbacks -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.answered_at = self.last_read_at
        self._pieces.append(body)

    def on_chunk_header(self) -> None:
        self._chunk_closed = False

    def on_chunk_complete(self) -> None:
        self._chunk_closed = True

    def on_message_complete(self) -> None:
        self._complete = True
        # Read now: llhttp resets its flags once the message is done.
        self._keep_alive = self._parser.should_keep_alive()
        self._sink = None
        self._framed = None

    # -- the request ---------------------------------------------------------------------

    async def request(
        self, head: bytes, payload: bytes, *, answers_whole: bool = False
    ) -> None:
        """Send one request and wait for the answer's head (``answers_whole``: the
        answer is one body, not a stream; the stall rule leaves it be)."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self._head = loop.create_future()
        self.read_timeout_s = self._client.first_token_timeout_s
        self.last_read_at = self.sent_at = time.monotonic()
        self.answered_at = None
        self.has_first_token = False
        self.answers_whole = answers_whole
        self._client.watch(self)
        self.transport.write(head + payload)
        await self._head

    def _reset(self) -> None:
        """Make a kept-alive connection ready for its next request."""
        self._parser = httptools.HttpResponseParser(self)
        self._buffer.clear()
        self._buffered = 0
        self._pieces.clear()
        self._sink = None
        self._framed = None
        self._chunk_closed = False
        self._at_boundary = False
        self._error = None
        self._complete = False
        self._keep_alive = False
        self._got_bytes = False
        self._head = None
        self.status = 0
        self.headers = []
        self.reused = True

    # -- the body -------------------------------------------------------------------------

    async def readany(self) -> bytes:
        """Return the body bytes read so far and not yet taken; b"" at the end.

        Raises:
            ConnectionError: the replica closed the connection mid-answer.
            TimeoutError: the replica was silent past its read timeout.
        """
        while True:
            if self._buffer:
                buffer = self._buffer
                chunk = buffer.popleft() if len(buffer) == 1 else b"".join(buffer)
                buffer.clear()
                if self._buffered > _PULL_HIGH_WATER:
                    self.resume_reading()
                self._buffered = 0
                return chunk
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read(self) -> bytes:
        """Read the whole body (an error's, or a short answer's)."""
        parts = []
        size = 0
        while chunk := await self.readany():
            parts.append(chunk)
            size += len(chunk)
            if size > _MAX_BODY_BYTES:
                raise ConnectionError("the replica's answer is too large")
        return b"".join(parts)

    def stream_to(self, sink: Sink, framed: FramedSink | None = None) -> None:
        """From now on give each read's body to ``sink`` (what it declines, and
        what is still unread, stays for ``readany``); with ``framed``, a read of
        whole chunks goes to it first, as it came."""
        if not self._complete:
            self._sink = sink
            self._framed = framed

    def expect_tokens(self) -> None:
        """The first token arrived: time reads by the inter-token timeout from now."""
        self.read_timeout_s = self._client.inter_token_timeout_s
        self.last_read_at = time.monotonic()
        self.has_first_token = True

    def pause_reading(self) -> None:
        """Stop reading the socket (the client is slow); nested with resume."""
        self._paused += 1
        if self._paused == 1 and self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        """Undo one ``pause_reading``."""
        self._paused -= 1
        if self._paused == 0 and self.transport is not None:
            self.last_read_at = time.monotonic()  # paused time is not silence
            self.transport.resume_reading()

    @property
    def is_paused(self) -> bool:
        return self._paused > 0

    def release(self) -> None:
        """Done with the answer: back to the pool if it was read to its end."""
        self._sink = self._framed = None
        self._client.unwatch(self)
        if self._complete and self._keep_alive and not self._paused:
            self._client.keep(self)
        else:
            self.close()

    def close(self) -> None:
        """Close the connection (an answer abandoned or broken)."""
        self._sink = self._framed = None
        self._client.unwatch(self)
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def time_out(self, silent_s: float) -> None:
        """Fail the read: the replica was silent for ``silent_s``."""
        self._fail(TimeoutError(f"the replica was silent for {silent_s:.1f} s"))

    def stalled(self, silent_s: float) -> None:
        """Fail the request before its first token: its replica has stalled."""
        self._fail(
            ReplicaStalled(
                f"the replica sent no answer for {silent_s:.1f} s while it held "
                "requests (stalled)"
            )
        )

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._sink = self._framed = None
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def chunk_data(data: bytes) -> bytes | None:
    """Return the data of ``data`` if it is whole HTTP/1.1 chunks (none of them
    the last, empty one), else None.

    Strict: a size line is hex digits only (no extensions, signs or spaces, which
    ``int`` would accept and a client's parser might not).
    """
    parts: list[bytes] = []
    start, length = 0, len(data)
    while start < length:
        line_end = data.find(b"\r\n", start, start + 18)
        if line_end <= start:
            return None
        size_line = data[start:line_end]
        if not size_line.isalnum():
            return None
        try:
            size = int(size_line, 16)
        except ValueError:
            return None
        end = line_end + 2 + size
        if size == 0 or data[end : end + 2] != b"\r\n":
            return None
        if start == 0 and end + 2 == length:
            return data[line_end + 2 : end]  # the common read: one chunk
        parts.append(data[line_end + 2 : end])
        start = end + 2
    return b"".join(parts) if parts else None


class EngineClient:
    """POST to replicas over kept-alive connections; one per gateway process."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        first_token_timeout_s: float = 30.0,
        inter_token_timeout_s: float = 15.0,
        engine_api_key: str = "",
        keepalive_s: float = 4.0,
        max_idle_per_replica: int = 1024,
        stall_after_s: float | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        # None: no stall rule here, only the first-token deadline.
        self.stall_after_s = stall_after_s
        self.first_token_timeout_s = first_token_timeout_s
        self.inter_token_timeout_s = inter_token_timeout_s
        self.keepalive_s = keepalive_s
        self.max_idle_per_replica = max_idle_per_replica
        self._auth = (
            b"authorization: Bearer " + engine_api_key.encode("latin-1") + b"\r\n"
            if engine_api_key
            else b""
        )
        self._idle: dict[tuple[str, int], list[EngineResponse]] = {}
        self._watched: set[EngineResponse] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._targets: dict[str, tuple[str, int, bytes]] = {}

    async def open(self) -> None:
        """Start the sweep of silent streams (on the running loop)."""
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep())

    async def close(self) -> None:
        """Stop the sweep and close every connection."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()
        for connection in list(self._watched):
            connection.close()

    async def post(
        self,
        base_url: str,
        path: str,
        payload: bytes,
        *,
        answers_whole: bool = False,
        extra_head: bytes = b"",
    ) -> EngineResponse:
        """POST ``payload`` (JSON) to ``base_url + path``; return the response once
        its head arrived. ``answers_whole``: the answer is one body (embeddings),
        which the stall rule does not time. ``extra_head``: header lines, each
        ending in CRLF (the trace's ``traceparent``: ``routing.traces``).

        Raises:
            OSError: no connection, or the replica closed it before answering.
            TimeoutError: connecting took longer than ``connect_timeout_s``.
        """
        host, port, host_header = self._target(base_url)
        head = (
            b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n%s%s\r\n"
            % (path.encode(), host_header, len(payload), self._auth, extra_head)
        )
        connection = self._reuse((host, port))
        if connection is not None:
            try:
                await connection.request(head, payload, answers_whole=answers_whole)
                return connection
            except OSError as exc:
                connection.close()
                # Closed by the server while idle, before it read the request:
                # send it again. Silence (TimeoutError is an OSError) is not.
                if connection._got_bytes or isinstance(exc, TimeoutError):
                    raise
            except BaseException:
                connection.close()
                raise
        connection = await self._connect(host, port)
        try:
            await connection.request(head, payload, answers_whole=answers_whole)
        except BaseException:
            connection.close()
            raise
        return connection

    def _target(self, base_url: str) -> tuple[str, int, bytes]:
        target = self._targets.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"not an http:// replica URL: {base_url!r}")
            port = parts.port or 80
            target = (parts.hostname, port, parts.netloc.encode("idna"))
            self._targets[base_url] = target
        return target

    async def _connect(self, host: str, port: int) -> EngineResponse:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, protocol = await loop.create_connection(
                lambda: EngineResponse(self, (host, port)), host, port
            )
        return protocol

    def _reuse(self, key: tuple[str, int]) -> EngineResponse | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.transport is not None and (
                now - connection.idle_since < self.keepalive_s
            ):
                connection._reset()
                return connection
            connection.close()
        return None

    def keep(self, connection: EngineResponse) -> None:
        """Put a connection whose answer was read to its end back in the pool."""
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) >= self.max_idle_per_replica:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    def forget(self, connection: EngineResponse) -> None:
        """A connection closed: out of the pool and the sweep."""
        self._watched.discard(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    def watch(self, connection: EngineResponse) -> None:
        self._watched.add(connection)

    def unwatch(self, connection: EngineResponse) -> None:
        self._watched.discard(connection)

    @property
    def sweep_s(self) -> float:
        """How often silent streams are looked for: a quarter of the shortest
        timeout (or stall rule), at most a second."""
        stall_s = self.stall_after_s or self.first_token_timeout_s
        return min(
            1.0,
            self.first_token_timeout_s / 4,
            self.inter_token_timeout_s / 4,
            stall_s / 4,
        )

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            now = time.monotonic()
            silent: list[tuple[EngineResponse, float]] = [
                (c, now - c.last_read_at)
                for c in self._watched
                if not c.is_paused and now - c.last_read_at > c.read_timeout_s
            ]
            for connection, silent_s in silent:
                self._watched.discard(connection)
                connection.time_out(silent_s)
            if self.stall_after_s is not None:
                self._fail_stalled(now, self.stall_after_s)

    def _fail_stalled(self, now: float, after_s: float) -> None:
        """Fail the requests waiting for a first token from a stalled replica, so
        that they go to another one now (``routing.domain.stall``)."""
        stalled = stalled_replicas(
            (
                WaitingStream(
                    c.key,
                    c.sent_at,
                    c.answered_at,
                    c.has_first_token,
                    answers_whole=c.answers_whole,
                )
                for c in self._watched
            ),
            now=now,
            after_s=after_s,
        )
        if not stalled:
            return
        for connection in [c for c in self._watched if c.key in stalled]:
            if not connection.has_first_token and not connection.answers_whole:
                self._watched.discard(connection)
                connection.stalled(stalled[connection.key])
