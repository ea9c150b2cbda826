"""ASGI entry point: Channels routes HTTP to Django (the gateway joins it later)."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from config.startup import log_backends  # noqa: E402

http_app = (
    ASGIStaticFilesHandler(django_asgi_app)
    if settings.PLATFORM_SERVE_STATIC
    else django_asgi_app
)
application = ProtocolTypeRouter({"http": http_app})
log_backends()
