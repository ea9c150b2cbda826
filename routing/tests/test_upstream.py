"""The upstream's read timeouts against a real HTTP server that goes silent.

``Upstream.chat`` (aiohttp, still used by shadow copies) and ``Upstream.stream``
(the engine client, ``routing.engine_http``, tested in depth in
``test_engine_http``) time reads the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from routing.upstream import Upstream

FIRST_TOKEN_S = 1.5
INTER_TOKEN_S = 0.5
# Timers fire late on a loaded machine, never early.
LATE_S = 0.7


@asynccontextmanager
async def replica(
    body: Callable[[web.StreamResponse], Awaitable[None]],
) -> AsyncIterator[str]:
    """Serve /v1/chat/completions: headers at once, then ``body`` writes the rest."""
    silence = asyncio.Event()  # never set: a stalled engine

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await body(response)
        await silence.wait()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    # Its handlers wait forever: shutting down must not wait for them.
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def nothing(response: web.StreamResponse) -> None:
    return None


async def one_token(response: web.StreamResponse) -> None:
    await response.write(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')


async def open_upstream() -> Upstream:
    upstream = Upstream(
        connect_timeout_s=1.0,
        first_token_timeout_s=FIRST_TOKEN_S,
        inter_token_timeout_s=INTER_TOKEN_S,
    )
    await upstream.open()
    return upstream


def test_silence_before_the_first_token_times_out_after_the_first_token_timeout() -> (
    None
):
    async def scenario() -> float:
        upstream = await open_upstream()
        try:
            async with replica(nothing) as url:
                response = await upstream.chat(url, b"{}")
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    # The bound only keeps a broken timeout from hanging the test.
                    await asyncio.wait_for(response.content.readany(), 10)
                response.close()
                return time.monotonic() - started
        finally:
            await upstream.close()

    waited = asyncio.run(scenario())
    assert FIRST_TOKEN_S - 0.05 <= waited < FIRST_TOKEN_S + LATE_S


def test_silence_after_the_first_token_times_out_after_the_inter_token_timeout() -> (
    None
):
    """GIVEN a replica that sends one token and then stalls
    WHEN the gateway has seen the first token (``expect_tokens``)
    THEN the next read fails after the inter-token timeout, not the first-token one.
    """

    async def scenario() -> float:
        upstream = await open_upstream()
        try:
            async with replica(one_token) as url:
                response = await upstream.chat(url, b"{}")
                assert b"content" in await response.content.readany()
                upstream.expect_tokens(response)
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(response.content.readany(), 10)
                response.close()
                return time.monotonic() - started
        finally:
            await upstream.close()

    waited = asyncio.run(scenario())
    assert INTER_TOKEN_S - 0.05 <= waited < INTER_TOKEN_S + LATE_S
    assert waited < FIRST_TOKEN_S


def test_tokens_closer_than_the_inter_token_timeout_keep_the_stream() -> None:
    async def steady(response: web.StreamResponse) -> None:
        for _ in range(10):  # a token every 0.1 s: 1 s in all, twice the timeout
            await asyncio.sleep(0.1)
            await response.write(b'data: {"choices":[{"delta":{}}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    async def scenario() -> bytes:
        upstream = await open_upstream()
        try:
            async with replica(steady) as url:
                response = await upstream.chat(url, b"{}")
                upstream.expect_tokens(response)
                body = b""
                while b"[DONE]" not in body:
                    body += await asyncio.wait_for(response.content.readany(), 10)
                response.close()
                return body
        finally:
            await upstream.close()

    assert asyncio.run(scenario()).count(b"\n\n") == 11


def test_stream_times_silence_before_and_after_the_first_token() -> None:
    """GIVEN a replica that sends one token and then stalls
    WHEN the gateway reads it over ``Upstream.stream``
    THEN the first read waits for the token, and once ``expect_tokens`` was called
    the next fails after the inter-token timeout: ``open`` started the sweep."""

    async def scenario() -> float:
        upstream = await open_upstream()
        try:
            async with replica(one_token) as url:
                response = await upstream.stream(url, b"{}")
                assert response.status == 200
                assert b"content" in await asyncio.wait_for(response.readany(), 10)
                response.expect_tokens()
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(response.readany(), 10)
                response.close()
                return time.monotonic() - started
        finally:
            await upstream.close()

    waited = asyncio.run(scenario())
    assert INTER_TOKEN_S - 0.05 <= waited < INTER_TOKEN_S + LATE_S


def test_stream_silence_before_the_first_token_times_out_after_the_first_token_timeout() -> (
    None
):
    async def scenario() -> float:
        upstream = await open_upstream()
        try:
            async with replica(nothing) as url:
                response = await upstream.stream(url, b"{}")
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(response.readany(), 10)
                response.close()
                return time.monotonic() - started
        finally:
            await upstream.close()

    waited = asyncio.run(scenario())
    assert FIRST_TOKEN_S - 0.05 <= waited < FIRST_TOKEN_S + LATE_S
