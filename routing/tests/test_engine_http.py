"""The engine client (``routing.engine_http``) against real sockets and exact reads.

Public surface tested: ``EngineClient.post``, ``EngineResponse`` (``readany``,
``read``, ``stream_to``, ``expect_tokens``, ``release``, ``close``).

Replicas here are raw asyncio servers on 127.0.0.1, so a test decides the chunked
encoding, when a connection closes and how many connections were accepted. Where
a test needs one socket read to hold exactly some bytes, it feeds the protocol's
``data_received`` itself (``fed_response``): loopback TCP may join two writes.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from routing.domain.stall import ReplicaStalled
from routing.engine_http import EngineClient, EngineResponse

FIRST_TOKEN_S = 1.5
INTER_TOKEN_S = 0.5
# Timers fire late on a loaded machine, never early; the sweep adds up to a quarter.
LATE_S = 0.7
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"
TOKEN = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'

# answer(writer, request_number) writes one answer; True keeps the connection.
Answer = Callable[[asyncio.StreamWriter, int], Awaitable[bool]]


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of HTTP/1.1 chunked encoding."""
    return b"%x\r\n%s\r\n" % (len(data), data)


class Replica:
    """A raw HTTP/1.1 server: counts connections and requests, answers with ``answer``."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.closed = 0  # connections that ended (either side)
        self.stop = asyncio.Event()  # answers that stall wait for it
        self._writers: list[asyncio.StreamWriter] = []
        self.url = ""

    async def serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
                await reader.readexactly(int(length.group(1)) if length else 0)
                self.requests += 1
                if not await self.answer(writer, self.requests):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()

    async def stall(self) -> bool:
        await self.stop.wait()
        return False


@asynccontextmanager
async def replica(answer: Answer) -> AsyncIterator[Replica]:
    served = Replica(answer)
    server = await asyncio.start_server(served.serve, "127.0.0.1", 0)
    served.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield served
    finally:
        served.stop.set()
        server.close()
        for writer in served._writers:
            writer.close()
        await server.wait_closed()


@asynccontextmanager
async def engine_client(**overrides: Any) -> AsyncIterator[EngineClient]:
    options: dict[str, Any] = {
        "connect_timeout_s": 1.0,
        "first_token_timeout_s": FIRST_TOKEN_S,
        "inter_token_timeout_s": INTER_TOKEN_S,
    } | overrides
    client = EngineClient(**options)
    await client.open()
    try:
        yield client
    finally:
        await client.close()


async def until(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll ``condition`` until it holds; fail after ``within_s``."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def read_all(response: EngineResponse) -> list[bytes]:
    reads = []
    while data := await asyncio.wait_for(response.readany(), 10):
        reads.append(data)
    return reads


def whole(body: bytes) -> Answer:
    """An answer of ``body`` in three chunks, each its own write, kept alive."""

    async def answer(writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD)
        third = len(body) // 3
        for part in (body[:third], body[third : 2 * third], body[2 * third :]):
            writer.write(chunk(part))
            await writer.drain()
        writer.write(END)
        await writer.drain()
        return True

    return answer


BODY = b"".join(TOKEN.replace(b'"a"', b'"%d"' % i) for i in range(30))


# -- answers ---------------------------------------------------------------------------


def test_a_streamed_answer_read_with_readany_is_the_bytes_the_replica_sent() -> None:
    async def scenario() -> tuple[EngineResponse, bytes]:
        async with replica(whole(BODY)) as served, engine_client() as client:
            response = await client.post(served.url, "/v1/chat/completions", b"{}")
            body = b"".join(await read_all(response))
            response.release()
            return response, body

    response, body = asyncio.run(scenario())
    assert response.status == 200
    assert (b"content-type", b"text/event-stream") in response.headers
    assert body == BODY


class FakeTransport(asyncio.Transport):
    """A transport that records what the protocol asks of it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.paused = False
        self.pauses = 0
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def pause_reading(self) -> None:
        assert not self.paused, "paused twice"
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        assert self.paused, "resumed while reading"
        self.paused = False

    def close(self) -> None:
        self.closed = True


async def fed_response(head: bytes = HEAD) -> tuple[EngineResponse, FakeTransport]:
    """A response whose socket reads are the test's calls of ``data_received``."""
    client = EngineClient(connect_timeout_s=1.0)
    response = EngineResponse(client, ("127.0.0.1", 1))
    transport = FakeTransport()
    response.connection_made(transport)
    requested = asyncio.ensure_future(response.request(b"POST / HTTP/1.1\r\n\r\n", b""))
    await asyncio.sleep(0)
    response.data_received(head)
    await requested
    return response, transport


def test_one_read_holding_several_chunks_is_one_readany() -> None:
    async def scenario() -> list[bytes]:
        response, _ = await fed_response()
        response.data_received(chunk(b"a") + chunk(b"bb") + chunk(b"ccc"))
        first = await response.readany()
        response.data_received(chunk(b"dd") + END)
        return [first, await response.readany(), await response.readany()]

    assert asyncio.run(scenario()) == [b"abbccc", b"dd", b""]


def test_an_error_answer_is_read_whole_with_read() -> None:
    error = b'{"error": {"message": "no such model", "code": 404}}'

    async def answer(writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(
            b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(error)
        )
        await writer.drain()
        writer.write(error[:10])  # the body in two writes
        await writer.drain()
        writer.write(error[10:])
        return True

    async def scenario() -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        async with replica(answer) as served, engine_client() as client:
            response = await client.post(served.url, "/v1/chat/completions", b"{}")
            body = await asyncio.wait_for(response.read(), 10)
            response.release()
            return response.status, body, response.headers

    status, body, headers = asyncio.run(scenario())
    assert status == 404
    assert body == error
    assert (b"content-length", b"%d" % len(error)) in headers


# -- keep-alive ------------------------------------------------------------------------


def test_sequential_requests_reuse_one_connection() -> None:
    async def scenario() -> tuple[int, list[bool], list[bytes]]:
        async with replica(whole(BODY)) as served, engine_client() as client:
            reused, bodies = [], []
            for _ in range(3):
                response = await client.post(served.url, "/v1/chat/completions", b"{}")
                bodies.append(b"".join(await read_all(response)))
                reused.append(response.reused)
                response.release()
            return served.connections, reused, bodies

    connections, reused, bodies = asyncio.run(scenario())
    assert connections == 1
    assert reused == [False, True, True]
    assert bodies == [BODY] * 3


@pytest.mark.parametrize("done", ["close", "unread-release", "unread-close"])
def test_a_connection_is_not_reused_after_close_or_an_unread_answer(done: str) -> None:
    complete = whole(BODY)

    async def answer(writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 1 and done != "close":
            writer.write(HEAD + chunk(BODY))  # an answer that has not ended
            return True
        return await complete(writer, n)

    async def scenario() -> tuple[int, int, bytes]:
        async with replica(answer) as served, engine_client() as client:
            response = await client.post(served.url, "/v1/chat/completions", b"{}")
            if done == "close":
                await read_all(response)
                response.close()
            elif done == "unread-release":
                response.release()  # the body was never read: not reusable
            else:
                response.close()
            # The first connection ends on the replica's side too.
            await until(lambda: served.closed == 1)
            second = await client.post(served.url, "/v1/chat/completions", b"{}")
            body = b"".join(await read_all(second))
            second.release()
            return served.connections, served.requests, body

    connections, requests, body = asyncio.run(scenario())
    assert (connections, requests) == (2, 2)
    assert body == BODY


def test_a_pooled_connection_the_replica_closed_while_idle_is_replaced() -> None:
    """GIVEN a replica that closes its kept-alive connection after one answer
    WHEN the next request finds that connection closed in the pool
    THEN it succeeds on a new connection."""
    answer = whole(BODY)

    async def close_after_answering(writer: asyncio.StreamWriter, n: int) -> bool:
        await answer(writer, n)
        return False  # no connection: close, as uvicorn does when idle

    async def scenario() -> tuple[int, bytes]:
        async with replica(close_after_answering) as served, engine_client() as client:
            first = await client.post(served.url, "/v1/chat/completions", b"{}")
            await read_all(first)
            first.release()
            await until(lambda: served.closed == 1)
            second = await client.post(served.url, "/v1/chat/completions", b"{}")
            body = b"".join(await read_all(second))
            second.release()
            return served.connections, body

    assert asyncio.run(scenario()) == (2, BODY)


def test_a_request_the_replica_closed_on_unanswered_is_sent_again() -> None:
    """GIVEN a pooled connection that the replica closes on reading the next request
    (uvicorn's idle close, met mid-flight)
    THEN the request is sent once more, on a new connection, and answered."""
    answer = whole(BODY)

    async def close_second(writer: asyncio.StreamWriter, n: int) -> bool:
        if n == 2:
            return False  # read the request, close without a byte of answer
        return await answer(writer, n)

    async def scenario() -> tuple[int, int, bytes]:
        async with replica(close_second) as served, engine_client() as client:
            first = await client.post(served.url, "/v1/chat/completions", b"{}")
            await read_all(first)
            first.release()
            second = await client.post(served.url, "/v1/chat/completions", b"{}")
            body = b"".join(await read_all(second))
            second.release()
            return served.connections, served.requests, body

    assert asyncio.run(scenario()) == (2, 3, BODY)


# -- timeouts --------------------------------------------------------------------------


def head_then(*reads: bytes) -> Callable[[Replica], Answer]:
    """An answer of the head and ``reads``, then silence."""

    def make(served: Replica) -> Answer:
        async def answer(writer: asyncio.StreamWriter, n: int) -> bool:
            writer.write(HEAD)
            for data in reads:
                writer.write(data)
            await writer.drain()
            return await served.stall()

        return answer

    return make


def silent(served: Replica) -> Answer:
    """An answer that never comes, not even its head."""

    async def answer(writer: asyncio.StreamWriter, n: int) -> bool:
        return await served.stall()

    return answer


@asynccontextmanager
async def stalling(make: Callable[[Replica], Answer]) -> AsyncIterator[Replica]:
    holder: list[Replica] = []

    async def answer(writer: asyncio.StreamWriter, n: int) -> bool:
        return await make(holder[0])(writer, n)

    async with replica(answer) as served:
        holder.append(served)
        yield served


def test_silence_before_the_first_token_fails_the_read_after_the_first_token_timeout() -> (
    None
):
    async def scenario() -> float:
        async with stalling(head_then()) as served, engine_client() as client:
            response = await client.post(served.url, "/v1/chat/completions", b"{}")
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(response.readany(), 10)
            response.close()
            return time.monotonic() - started

    waited = asyncio.run(scenario())
    assert FIRST_TOKEN_S - 0.05 <= waited < FIRST_TOKEN_S + LATE_S


def test_a_replica_silent_before_its_head_fails_the_post_after_the_first_token_timeout() -> (
    None
):
    async def scenario() -> tuple[float, int]:
        async with stalling(silent) as served, engine_client() as client:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(
                    client.post(served.url, "/v1/chat/completions", b"{}"), 10
                )
            return time.monotonic() - started, served.requests

    waited, requests = asyncio.run(scenario())
    assert FIRST_TOKEN_S - 0.05 <= waited < FIRST_TOKEN_S + LATE_S
    assert requests == 1


def test_a_reused_connection_silent_before_its_head_fails_once() -> None:
    """GIVEN a replica that answered once on a kept-alive connection
    WHEN it stays silent on the next request (no head)
    THEN the post fails after one first-token timeout, the request sent once."""
    answer = whole(BODY)

    def make(served: Replica) -> Answer:
        async def first_then_stall(writer: asyncio.StreamWriter, n: int) -> bool:
            return await answer(writer, n) if n == 1 else await served.stall()

        return first_then_stall

    async def scenario() -> tuple[float, int, int]:
        async with stalling(make) as served, engine_client() as client:
            first = await client.post(served.url, "/v1/chat/completions", b"{}")
            await read_all(first)
            first.release()
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(
                    client.post(served.url, "/v1/chat/completions", b"{}"), 10
                )
            return time.monotonic() - started, served.connections, served.requests

    waited, connections, requests = asyncio.run(scenario())
    # One connection, reused; the first answer, and the silent request once.
    assert (connections, requests) == (1, 2)
    assert waited < FIRST_TOKEN_S + LATE_S


def test_silence_after_expect_tokens_fails_the_read_after_the_inter_token_timeout() -> (
    None
):
    async def scenario() -> float:
        async with (
            stalling(head_then(chunk(TOKEN))) as served,
            engine_client() as client,
        ):
            response = await client.post(served.url, "/v1/chat/completions", b"{}")
            assert await asyncio.wait_for(response.readany(), 10) == TOKEN
            response.expect_tokens()
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(response.readany(), 10)
            response.close()
            return time.monotonic() - started

    waited = asyncio.run(scenario())
    assert INTER_TOKEN_S - 0.05 <= waited < INTER_TOKEN_S + LATE_S
    assert waited < FIRST_TOKEN_S


def test_tokens_closer_than_the_inter_token_timeout_keep_the_stream() -> None:
    async def steady(writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD)
        for _ in range(10):  # a token every 0.1 s: 1 s in all, twice the timeout
            await asyncio.sleep(0.1)
            writer.write(chunk(TOKEN))
            await writer.drain()
        writer.write(chunk(b"data: [DONE]\n\n") + END)
        return True

    async def scenario() -> bytes:
        async with replica(steady) as served, engine_client() as client:
            response = await client.post(served.url, "/v1/chat/completions", b"{}")
            response.expect_tokens()
            body = b"".join(await read_all(response))
            response.release()
            return body

    assert asyncio.run(scenario()) == TOKEN * 10 + b"data: [DONE]\n\n"


def test_connecting_to_a_closed_port_raises_oserror_at_once() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario() -> float:
        async with engine_client() as client:
            started = time.monotonic()
            with pytest.raises(OSError):
                await client.post(
                    f"http://127.0.0.1:{port}", "/v1/chat/completions", b"{}"
                )
            return time.monotonic() - started

    assert asyncio.run(scenario()) < 0.5


# -- push ------------------------------------------------------------------------------


class Sink:
    """Takes every read but those holding ``decline``."""

    def __init__(self, decline: bytes = b"[DONE]") -> None:
        self.decline = decline
        self.taken: list[bytes] = []
        self.offered: list[bytes] = []

    def __call__(self, data: bytes) -> bool:
        self.offered.append(data)
        if self.decline in data:
            return False
        self.taken.append(data)
        return True


def test_stream_to_gives_reads_to_the_sink_and_readany_only_what_it_declined() -> None:
    async def scenario() -> tuple[Sink, list[bytes]]:
        response, _ = await fed_response()
        response.data_received(chunk(b"unread"))  # before stream_to: stays unread
        sink = Sink()
        response.stream_to(sink)
        response.data_received(chunk(b"one"))
        response.data_received(chunk(b"two") + chunk(b"three"))
        read = [await response.readany()]
        response.data_received(chunk(b"[DONE]"))
        response.data_received(END)
        return sink, [*read, await response.readany(), await response.readany()]

    sink, read = asyncio.run(scenario())
    # Unread bytes are still there: reads after them queue behind them, in order.
    assert sink.taken == []
    assert read == [b"unreadonetwothree", b"[DONE]", b""]


def test_after_the_sink_declines_reads_wait_for_readany_then_go_to_the_sink() -> None:
    async def scenario() -> tuple[Sink, list[bytes]]:
        response, _ = await fed_response()
        sink = Sink(decline=b"cut")
        response.stream_to(sink)
        response.data_received(chunk(b"one"))
        response.data_received(chunk(b"cut"))  # declined
        response.data_received(chunk(b"two"))  # behind it: not offered
        read = [await response.readany()]
        response.data_received(chunk(b"three"))  # the buffer was taken: offered
        response.data_received(chunk(b"four") + END)  # the end: for readany
        read += [await response.readany(), await response.readany()]
        return sink, read

    sink, read = asyncio.run(scenario())
    assert sink.offered == [b"one", b"cut", b"three"]
    assert sink.taken == [b"one", b"three"]
    assert read == [b"cuttwo", b"four", b""]


def test_push_over_a_real_socket_keeps_every_byte_in_order() -> None:
    """Every byte reaches the sink or ``readany``, each once, in order."""
    reads = [chunk(TOKEN * i) for i in range(1, 20)] + [chunk(b"data: [DONE]\n\n"), END]

    async def answer(writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD)
        for data in reads:
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0)  # let the client read between writes
        return True

    async def scenario() -> tuple[list[bytes], Sink]:
        async with replica(answer) as served, engine_client() as client:
            response = await client.post(served.url, "/v1/chat/completions", b"{}")
            got: list[bytes] = []
            sink = Sink()

            def ordered(data: bytes) -> bool:
                taken = sink(data)
                if taken:
                    got.append(data)
                return taken

            response.stream_to(ordered)
            got += await read_all(response)
            response.release()
            return got, sink

    got, sink = asyncio.run(scenario())
    assert b"".join(got) == TOKEN * sum(range(1, 20)) + b"data: [DONE]\n\n"
    assert sink.taken  # push was used


def test_an_answer_that_comes_whole_is_not_failed_by_the_stall_rule() -> None:
    """GIVEN a replica that computes for longer than the stall rule's time, then
    sends its answer whole (an embeddings body)
    WHEN the request says its answer comes whole
    THEN it gets the body; the same silence before a stream's first token is a
    stall.
    """
    body = b'{"data": []}'

    async def slow_whole(writer: asyncio.StreamWriter, n: int) -> bool:
        await asyncio.sleep(0.8)  # the engine computing: past the stall rule's 0.3 s
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        return True

    async def scenario() -> bytes:
        async with (
            replica(slow_whole) as served,
            engine_client(stall_after_s=0.3) as client,
        ):
            response = await client.post(
                served.url, "/v1/embeddings", b"{}", answers_whole=True
            )
            whole = await response.read()
            with pytest.raises(ReplicaStalled):
                await client.post(served.url, "/v1/chat/completions", b"{}")
            return whole

    assert asyncio.run(scenario()) == body
