"""What a process says about its backends when it starts."""

from __future__ import annotations

import logging

from django.conf import settings

logger = logging.getLogger("config.startup")


def describe_backends() -> list[str]:
    """Return one line per backend choice that an operator should know about."""
    lines = []
    vendor = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
    lines.append(f"database: {vendor}")
    if settings.REDIS_URL:
        lines.append("redis: cache, channel layer and Celery broker on REDIS_URL")
    else:
        lines.append(
            "redis: REDIS_URL unset; using in-memory cache and channel layer and a "
            "filesystem Celery broker (one gateway process per machine)"
        )
    if settings.SECRET_KEY_IS_EPHEMERAL:
        lines.append("secret key: SECRET_KEY unset; a random key for this process only")
    lines.append(f"region: {settings.PLATFORM_REGION}")
    return lines


def log_backends() -> None:
    """Log the backend summary once at process start."""
    for line in describe_backends():
        logger.info("%s", line)
