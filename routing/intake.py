"""What a request brings the gateway: its team key and its JSON body.

Public surface: ``authenticate``, ``read_json``, ``header_text``, ``refuse_body``.

The key is looked up by its SHA-256 in the ``ConfigSnapshot`` (keys are never
stored in clear); the body is read within the gateway's size limit and parsed
within bounds (``config.json_body``). Whatever a client sends, the answer is a
``GatewayError`` in OpenAI's shape (401, 413, 400) or ``ClientGone``, never
anything else. Nothing here touches the ORM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from config.asgi_io import Receive, Scope
from config.json_body import BodyError, parse_json_object
from routing.domain.snapshot import ConfigSnapshot, KeyRecord
from routing.responses import ClientGone, GatewayError

__all__ = ["authenticate", "header_text", "read_json", "refuse_body"]


def authenticate(scope: Scope, snapshot: ConfigSnapshot) -> KeyRecord:
    """Return the active key the request's bearer secret opens (its team, its id).

    Raises:
        GatewayError: 401, no key or one that is not active in the snapshot.
    """
    header = b""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            header = value
            break
    scheme, _, secret = header.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise GatewayError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            error_type="invalid_request_error",
        )
    key = snapshot.keys.get(hashlib.sha256(secret.strip().encode()).hexdigest())
    if key is None:
        raise GatewayError(
            401,
            "invalid API key",
            code="invalid_api_key",
            error_type="invalid_request_error",
        )
    return key


async def read_json(
    receive: Receive, headers: Mapping[bytes, bytes], limit: int
) -> dict[str, Any]:
    """Read the request body, at most ``limit`` bytes, as a JSON object.

    Raises:
        GatewayError: 413 too large, 400 not a JSON object or out of bounds
            (``config.json_body``).
        ClientGone: the client left before sending the whole body.
    """
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(
            413, f"request body is larger than {limit} bytes", code="request_too_large"
        )
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(
                413,
                f"request body is larger than {limit} bytes",
                code="request_too_large",
            )
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    try:
        return parse_json_object(b"".join(chunks))
    except BodyError as exc:
        raise refuse_body(exc) from None


def refuse_body(exc: BodyError) -> GatewayError:
    """Return the 400 for a body (or a field of it) that OpenAI would refuse."""
    return GatewayError(400, exc.message, param=exc.param, code=exc.code)


def header_text(headers: Mapping[bytes, bytes], name: bytes) -> str | None:
    """Return a request header's value as text (Latin-1, as HTTP sends it)."""
    value = headers.get(name)
    return value.decode("latin-1") if value is not None else None
