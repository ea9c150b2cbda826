"""Celery tasks of metering."""

from __future__ import annotations

import redis
from celery import shared_task
from django.conf import settings
from django.utils import timezone

from metering import services


@shared_task(name="metering.flush_usage", acks_late=True, ignore_result=True)
def flush_usage() -> int:
    """Write the closed minutes' usage from Redis to rows; return how many rows.

    The rollout guards' figures are flushed with it (every listed bucket, the
    current one included, for this worker's region). Idempotent, so a
    redelivered or overlapping run is harmless. Without Redis the embedded
    gateway flushes its own ledger and figures, and this returns 0.
    """
    if not settings.REDIS_URL:
        return 0
    now = timezone.now()
    prefix = settings.REDIS_KEY_PREFIX
    with redis.Redis.from_url(settings.REDIS_URL, socket_timeout=10) as client:
        rows = services.flush_redis_usage(client=client, prefix=prefix, now=now)
        services.flush_redis_figures(
            client=client, prefix=prefix, region=settings.PLATFORM_REGION, now=now
        )
        return rows
