"""uvicorn's httptools protocol with one ASGI extension: writing chunk frames.

Public surface: ``GatewayHttpProtocol``.

An engine streams its SSE events as HTTP/1.1 chunks, and the gateway answers its
client in chunks too: a read of whole chunks holding whole token events can go
to the client's socket as it came, framing and all, instead of being de-chunked,
put in an ASGI message, awaited through the server's ``send`` and chunked again.
For that the gateway needs to write to the client's transport, which ASGI does
not offer; this protocol offers it as the extension ``config.asgi_io.CHUNKED_WRITE`` in the
request's scope: a function taking already-framed chunks that writes them and
returns True, or writes nothing and returns False when the server's own path
must be taken (the response has not begun or has ended, is not chunked, the
client left or is not reading). The gateway uses it when it is there and
``send`` otherwise (daphne, granian, tests calling the app in process).

It reads the state of uvicorn's ``RequestResponseCycle`` (``response_started``,
``chunked_encoding``, ``flow``): tests/test_servers.py holds it to the uvicorn
installed, through a real server.

Run with ``uvicorn --http config.http_protocol:GatewayHttpProtocol``
(``localrun.processes.gateway_argv`` does).
"""

from __future__ import annotations

from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import (
    HttpToolsProtocol,
    RequestResponseCycle,
)

from config.asgi_io import CHUNKED_WRITE, ChunkedWrite

__all__ = ["GatewayHttpProtocol"]


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's protocol, with ``CHUNKED_WRITE`` in every request's scope."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        scope = cast(dict[str, Any], cycle.scope)
        scope.setdefault("extensions", {})[CHUNKED_WRITE] = _chunked_write(cycle)
        super()._start_asgi_task(cycle, app)


def _chunked_write(cycle: RequestResponseCycle) -> ChunkedWrite:
    def write(frames: bytes) -> bool:
        if (
            cycle.chunked_encoding
            and cycle.response_started
            and not cycle.response_complete
            and not cycle.disconnected
            and not cycle.flow.write_paused
        ):
            cycle.transport.write(frames)
            return True
        return False

    return write
