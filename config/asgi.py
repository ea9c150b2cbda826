"""ASGI entry point: ``/v1/*``, ``/tokenize`` and ``/healthz`` to the gateway, the
rest (and the Files and Batch APIs under ``/v1/files`` and ``/v1/batches``, a
team's usage under ``/v1/organization`` and the API's schema, ``/v1/openapi.json``)
to Django.

Channels' ``ProtocolTypeRouter`` sits on top; the gateway is a raw ASGI app (the
token stream is the hottest path and measured against a bare relay), Django serves
the console, the control plane and ``/metrics``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from config.errors import error_body  # noqa: E402
from config.startup import log_backends  # noqa: E402
from routing.runtime import get_gateway  # noqa: E402

django_http = (
    ASGIStaticFilesHandler(django_asgi_app)
    if settings.PLATFORM_SERVE_STATIC
    else django_asgi_app
)
gateway = get_gateway()
# vLLM serves /tokenize at the root, and so does the gateway (`vllm bench serve`).
_GATEWAY_PATHS = frozenset({"/healthz", "/tokenize"})
# The Files and Batch APIs and a team's usage read the database: Django serves
# them (batches.api, metering.api), and the schema of all /v1 (config.v1_schema).
_DJANGO_V1 = ("/v1/files", "/v1/batches", "/v1/organization", "/v1/openapi.json")


def _is_django_v1(path: str) -> bool:
    return any(path == p or path.startswith(f"{p}/") for p in _DJANGO_V1)


async def http_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Send the OpenAI API to the gateway and everything else to Django."""
    path = scope["path"]
    if _is_django_v1(path):
        if await refuse_oversized_upload(scope, send):
            return
        await django_http(scope, receive, send)
    elif path.startswith("/v1/") or path in _GATEWAY_PATHS:
        await gateway(scope, receive, send)
    else:
        await django_http(scope, receive, send)


async def refuse_oversized_upload(scope: dict[str, Any], send: Any) -> bool:
    """Answer 413 before reading a body whose Content-Length is over the batch file
    limit (Django would spool all of it first); True when it did."""
    length = dict(scope.get("headers") or ()).get(b"content-length")
    limit = settings.PLATFORM_BATCH_FILE_MAX_BYTES
    # A multipart body carries its boundaries and field headers beside the file.
    if length is None or not length.isdigit() or int(length) <= limit + 64 * 1024:
        return False
    body = json.dumps(
        error_body(
            413,
            f"the body is larger than the {limit} bytes allowed for a file",
            code="file_too_large",
        )
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
    return True


application = ProtocolTypeRouter({"http": http_app, "lifespan": gateway})
log_backends()
