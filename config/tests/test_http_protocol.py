"""The chunk-frame write extension, through a real uvicorn with the gateway's protocol.

The extension reads uvicorn's request cycle; these tests hold it to the uvicorn
installed: frames written through it reach the client inside the chunked answer
``send`` began and ends, and it refuses (writing nothing) whenever the server's own
path must be taken.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import uvicorn

from config.asgi_io import CHUNKED_WRITE
from config.http_protocol import GatewayHttpProtocol


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _serve(app: Any, check: Any) -> None:
    port = _free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=GatewayHttpProtocol,
        lifespan="off",
        log_level="warning",
        access_log=False,
    )
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as session:
            await check(session, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        await serving


def test_frames_written_through_the_extension_reach_the_client_in_order() -> None:
    verdicts: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        write = scope["extensions"][CHUNKED_WRITE]
        verdicts.append(write(b"1\r\nx\r\n"))  # before the answer began: refused
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        verdicts.append(write(b"5\r\nhello\r\n2\r\n, \r\n"))
        await send({"type": "http.response.body", "body": b"!", "more_body": False})
        verdicts.append(write(b"1\r\nz\r\n"))  # after it ended: refused

    async def check(session: aiohttp.ClientSession, url: str) -> None:
        async with session.get(url) as response:
            assert response.headers["transfer-encoding"] == "chunked"
            assert await response.read() == b"ahello, !"
        # The connection is still good for the next request.
        async with session.get(url) as response:
            assert await response.read() == b"ahello, !"

    asyncio.run(_serve(app, check))
    assert verdicts == [False, True, False] * 2


def test_a_response_with_a_content_length_is_never_written_to_in_frames() -> None:
    verdicts: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        write = scope["extensions"][CHUNKED_WRITE]
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"2")],
            }
        )
        verdicts.append(write(b"1\r\nx\r\n"))
        await send({"type": "http.response.body", "body": b"ok"})

    async def check(session: aiohttp.ClientSession, url: str) -> None:
        async with session.get(url) as response:
            assert await response.read() == b"ok"

    asyncio.run(_serve(app, check))
    assert verdicts == [False]


def test_a_client_that_left_is_not_written_to() -> None:
    verdicts: list[bool] = []
    left = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        write = scope["extensions"][CHUNKED_WRITE]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        verdicts.append(write(b"1\r\nx\r\n"))
        left.set()

    async def check(session: aiohttp.ClientSession, url: str) -> None:
        response = await session.get(url)
        assert await response.content.readany() == b"a"
        response.close()
        async with asyncio.timeout(10):
            await left.wait()

    asyncio.run(_serve(app, check))
    assert verdicts == [False]
