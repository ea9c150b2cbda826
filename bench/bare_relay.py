"""The bare relay the gateway is measured against: forward the body, relay the bytes.

A Channels ``ProtocolTypeRouter({"http": relay})`` around a raw ASGI callable, served
like the gateway (uvicorn, uvloop + httptools, no access log). It reads the request
body, POSTs it to an upstream with one shared aiohttp ``ClientSession``
(``TCPConnector(limit=0)``) and sends the response bytes on as they arrive, without
parsing anything: no auth, no routing, no metering. Upstreams come from
``BARE_RELAY_UPSTREAMS`` (comma-separated base URLs); a request goes to the one its
``x-conversation-id`` hashes to.

``BARE_RELAY_MODE`` adds, for decomposing the gateway's cost, pieces of the
gateway's relay loop (copied from ``routing/relay.py``), comma-separated:
``race`` races every upstream read against the client's disconnect (a task and
``asyncio.wait`` per read, as ``_race`` does); ``parse`` splits the stream into
whole SSE events, checks each for ``[DONE]``, usage and error markers and sends the
complete ones joined; ``deep`` relays from six coroutine calls down (the depth of
the gateway's call chain), to price resuming a deep chain on every chunk;
``consumer`` serves the relay as a Channels ``AsyncHttpConsumer`` (``send_body``
per chunk), the issue's "minimal Channels consumer". Run from the repository root:

    BARE_RELAY_UPSTREAMS=http://127.0.0.1:9101 .venv/bin/uvicorn bench.bare_relay:application \
        --port 8200 --loop uvloop --http httptools --no-access-log --lifespan off
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import zlib
from collections.abc import Iterable
from typing import Any

import aiohttp
from channels.routing import ProtocolTypeRouter

from config.asgi_io import wait_disconnect

UPSTREAMS = [
    url.rstrip("/")
    for url in os.environ.get("BARE_RELAY_UPSTREAMS", "http://127.0.0.1:9101").split(
        ","
    )
    if url
]
MODE = {m for m in os.environ.get("BARE_RELAY_MODE", "").split(",") if m}
_session: aiohttp.ClientSession | None = None
_EVENT_END = b"\n\n"
_USAGE_MARK = b'"choices":[]'


def session() -> aiohttp.ClientSession:
    global _session
    if _session is None:
        _session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, connect=2.0),
            auto_decompress=False,
        )
    return _session


def _upstream(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The upstream a request's ``x-conversation-id`` header hashes to."""
    conversation = b""
    for name, value in headers:
        if name == b"x-conversation-id":
            conversation = value
            break
    return UPSTREAMS[zlib.crc32(conversation) % len(UPSTREAMS)]


async def relay(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Forward one request to an upstream and its answer back, byte for byte."""
    if scope["path"] == "/healthz":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    upstream = _upstream(scope["headers"])
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    async with session().post(
        upstream + scope["path"],
        data=body,
        headers={"content-type": "application/json"},
    ) as response:
        content_type = response.headers.get("content-type", "text/event-stream")
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [(b"content-type", content_type.encode())],
            }
        )
        if not MODE & {"race", "parse"}:
            async for chunk in response.content.iter_any():
                await send(
                    {"type": "http.response.body", "body": chunk, "more_body": True}
                )
        else:
            await _relay_like_gateway(response, receive, send)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _relay_like_gateway(
    response: aiohttp.ClientResponse, receive: Any, send: Any
) -> None:
    """The gateway's relay loop, with only the pieces named in ``MODE``."""
    race = "race" in MODE
    parse = "parse" in MODE
    disconnected = asyncio.ensure_future(wait_disconnect(receive)) if race else None
    reader = response.content
    buffer = b""
    try:
        while True:
            if disconnected is not None:
                chunk = await _race(reader.readany(), disconnected)
            else:
                chunk = await reader.readany()
            if not chunk:
                return
            if not parse:
                await send(
                    {"type": "http.response.body", "body": chunk, "more_body": True}
                )
                continue
            buffer += chunk
            end = buffer.rfind(_EVENT_END)
            if end < 0:
                continue
            complete, buffer = buffer[: end + 2], buffer[end + 2 :]
            out = []
            for event in complete.split(_EVENT_END):
                if not event:
                    continue
                if event.startswith(b"data: [DONE]"):
                    out.append(event)
                    continue
                if _USAGE_MARK in event:
                    out.append(event)  # the gateway parses and rewrites this one
                    continue
                if event.startswith(b'data: {"error"'):
                    out.append(event)
                    continue
                out.append(event)
            if out:
                await send(
                    {
                        "type": "http.response.body",
                        "body": _EVENT_END.join(out) + _EVENT_END,
                        "more_body": True,
                    }
                )
    finally:
        if disconnected is not None:
            disconnected.cancel()


class _ClientGone(Exception):
    pass


async def _race(awaitable: Any, disconnected: asyncio.Future[None]) -> Any:
    """Await ``awaitable`` unless the client disconnects first (as the gateway)."""
    if disconnected.done():
        raise _ClientGone
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait(
        {task, disconnected}, return_when=asyncio.FIRST_COMPLETED
    )
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise _ClientGone


_DEPTH = 6  # the gateway's await chain below the router: http_app .. Relay.run


async def _nested(
    scope: dict[str, Any], receive: Any, send: Any, depth: int = _DEPTH
) -> None:
    """Relay from ``depth`` coroutine calls down, as a deep call chain would."""
    if depth:
        await _nested(scope, receive, send, depth - 1)
    else:
        await relay(scope, receive, send)


def _consumer_app() -> Any:
    """The issue's "minimal Channels consumer that only forwards bytes"."""
    from django.conf import settings

    if not settings.configured:
        settings.configure()  # no CHANNEL_LAYERS: a consumer without a channel layer
    from channels.generic.http import AsyncHttpConsumer

    class RelayConsumer(AsyncHttpConsumer):
        async def handle(self, body: bytes) -> None:
            if self.scope["path"] == "/healthz":
                await self.send_response(200, b"ok")
                return
            async with session().post(
                _upstream(self.scope["headers"]) + self.scope["path"],
                data=body,
                headers={"content-type": "application/json"},
            ) as response:
                content_type = response.headers.get("content-type", "text/event-stream")
                await self.send_headers(
                    status=response.status,
                    headers=[(b"content-type", content_type.encode())],
                )
                async for chunk in response.content.iter_any():
                    await self.send_body(chunk, more_body=True)
            await self.send_body(b"")

    return RelayConsumer.as_asgi()


if "consumer" in MODE:
    application = ProtocolTypeRouter({"http": _consumer_app()})
else:
    application = ProtocolTypeRouter({"http": _nested if "deep" in MODE else relay})
