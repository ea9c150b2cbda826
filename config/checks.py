"""System checks for settings that are valid alone but wrong together."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register


@register(Tags.security, deploy=True)
def check_secret_key(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn when SECRET_KEY is drawn per process (sessions end at restart)."""
    if settings.SECRET_KEY_IS_EPHEMERAL:
        return [
            Warning(
                "SECRET_KEY is not set: each process uses its own random key, so "
                "console sessions end at restart and differ between processes.",
                hint="Set SECRET_KEY or SECRET_KEY_FILE.",
                id="config.W001",
            )
        ]
    return []


@register()
def check_heartbeats(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The database may hear beats less often than Redis, never more often."""
    if settings.PLATFORM_HEARTBEAT_DB_S < settings.PLATFORM_HEARTBEAT_S:
        return [
            Error(
                "PLATFORM_HEARTBEAT_DB_S must not be shorter than PLATFORM_HEARTBEAT_S",
                id="config.E003",
            )
        ]
    return []


@register()
def check_storage_roots(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Every storage root must be an absolute URI with a scheme, ending in '/'."""
    errors: list[CheckMessage] = []
    if not settings.PLATFORM_STORAGE_ROOTS:
        errors.append(
            Error(
                "PLATFORM_STORAGE_ROOTS is empty: no weights can be registered.",
                id="config.E001",
            )
        )
    for root in settings.PLATFORM_STORAGE_ROOTS:
        parts = urlsplit(root)
        if not parts.scheme or not root.endswith("/"):
            errors.append(
                Error(
                    f"storage root {root!r} must be a URI with a scheme that ends "
                    "in '/' (s3://bucket/prefix/, file:///srv/weights/)",
                    id="config.E002",
                )
            )
    return errors


@register()
def check_batch_storage(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The batch files' place must lie under a storage root (the same rule as any
    URI the platform reads or writes)."""
    from models_registry.domain.identity import uri_errors

    uri = settings.PLATFORM_BATCH_STORAGE_URI
    problems = uri_errors(uri, list(settings.PLATFORM_STORAGE_ROOTS))
    if problems or not uri.endswith("/"):
        reason = "; ".join(problems) or "it must end in '/'"
        return [
            Error(
                f"PLATFORM_BATCH_STORAGE_URI={uri!r}: {reason}",
                id="batches.E001",
            )
        ]
    return []


@register()
def check_routing_policy(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The default routing policy must name a registered policy."""
    from routing.domain.policies import POLICIES

    if settings.PLATFORM_ROUTING_POLICY not in POLICIES:
        return [
            Error(
                f"PLATFORM_ROUTING_POLICY={settings.PLATFORM_ROUTING_POLICY!r} is not a "
                f"routing policy ({', '.join(sorted(POLICIES))})",
                id="routing.E001",
            )
        ]
    return []


@register()
def check_batch_ceiling(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Batch must be admissible below some share of the pool, and its lane some
    share of it: each in (0, 1]."""
    errors: list[CheckMessage] = []
    ceiling = settings.PLATFORM_BATCH_CEILING
    if not 0.0 < ceiling <= 1.0:
        errors.append(
            Error(
                f"PLATFORM_BATCH_CEILING={ceiling} must be above 0 and at most 1 (the "
                "share of a pool's capacity below which batch requests are admitted)",
                id="routing.E002",
            )
        )
    lane = settings.PLATFORM_BATCH_LANE
    if not 0.0 < lane <= 1.0:
        errors.append(
            Error(
                f"PLATFORM_BATCH_LANE={lane} must be above 0 and at most 1 (the share "
                "of a pool's capacity the batch tier may hold in flight)",
                id="routing.E003",
            )
        )
    return errors
