"""ASGI types, and waiting for a client to leave, for the platform's raw ASGI apps.

Public surface: ``Scope``, ``Message``, ``Receive``, ``Send``, ``wait_disconnect``,
``CHUNKED_WRITE``, ``ChunkedWrite``.

The gateway, the simulated replica and the bench relays are raw ASGI callables (the
token stream is measured per event); they share these so none redefines them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = [
    "CHUNKED_WRITE",
    "ChunkedWrite",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "wait_disconnect",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# The scope extension of a server that lets the app write complete HTTP/1.1
# chunks (size line, data, CRLF; never the last chunk) to a chunked response it
# began with ``send``; False: not now, use ``send`` (``config.http_protocol``).
CHUNKED_WRITE = "platform.http.chunked_write"
ChunkedWrite = Callable[[bytes], bool]


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (``http.disconnect``).

    Call it after the request body has been read: every other message is skipped.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
