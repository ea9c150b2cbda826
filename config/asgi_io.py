"""ASGI types, and waiting for a client to leave, for the platform's raw ASGI apps.

Public surface: ``Scope``, ``Message``, ``Receive``, ``Send``, ``wait_disconnect``.

The gateway, the simulated replica and the bench relays are raw ASGI callables (the
token stream is measured per event); they share these so none redefines them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["Message", "Receive", "Scope", "Send", "wait_disconnect"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (``http.disconnect``).

    Call it after the request body has been read: every other message is skipped.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
