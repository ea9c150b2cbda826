"""ASGI entry point: ``/v1/*``, ``/tokenize`` and ``/healthz`` to the gateway, the
rest to Django.

Channels' ``ProtocolTypeRouter`` sits on top; the gateway is a raw ASGI app (the
token stream is the hottest path and measured against a bare relay), Django serves
the console, the control plane and ``/metrics``.
"""

from __future__ import annotations

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

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


async def http_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Send the OpenAI API to the gateway and everything else to Django."""
    path = scope["path"]
    if path.startswith("/v1/") or path in _GATEWAY_PATHS:
        await gateway(scope, receive, send)
    else:
        await django_http(scope, receive, send)


application = ProtocolTypeRouter({"http": http_app, "lifespan": gateway})
log_backends()
