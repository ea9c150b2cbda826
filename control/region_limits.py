"""The live tick of one limit across regions: publish demand, share the limits.

Public surface: ``ShareSettings``, ``share_settings``, ``share_region_limits``,
``read_region_demand``.

Every few seconds each region's beat runs this tick (``control.share_region_limits``):

1. read the region's demand per ``team:model`` over the window from its own Redis
   (the slots the gateways add each charge to: ``routing.region_limits``);
2. publish it to the control plane: upsert the region's rows of ``region_demand``
   (and its beat row), drop its rows of keys with no demand left;
3. read every region's rows and compute this region's share of each key with the
   pure policy (``routing.domain.region_shares.region_shares``);
4. replace the region's shares hash in Redis, where its gateways read them.

Step 2 or 3 failing (the control plane down) leaves step 4 undone: the region
keeps its last shares. The bound this gives is in ``docs/platform-admins.md``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.db import transaction

from accounts.models import RegionDemand
from routing.domain.region_shares import (
    DEFAULT_FIELD,
    demand_slot,
    demand_slot_key,
    region_shares,
    shares_key,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ShareSettings",
    "read_region_demand",
    "share_region_limits",
    "share_settings",
]

# The region's beat row in region_demand.
_BEAT_KEY = ""


@dataclass(frozen=True, slots=True)
class ShareSettings:
    """The tick's bounds (``PLATFORM_LIMIT_SHARES_*``)."""

    window_s: float = 30.0
    slot_s: float = 5.0
    floor: float = 0.05
    stale_after_s: float = 6.0


def share_settings() -> ShareSettings:
    """Return the tick's bounds from Django settings."""
    return ShareSettings(
        window_s=settings.PLATFORM_LIMIT_SHARES_WINDOW_S,
        slot_s=settings.PLATFORM_LIMIT_SHARES_SLOT_S,
        floor=settings.PLATFORM_LIMIT_SHARES_FLOOR,
        stale_after_s=settings.PLATFORM_LIMIT_SHARES_STALE_S,
    )


def read_region_demand(
    client: redis.Redis, *, prefix: str, now: float, window_s: float, slot_s: float
) -> dict[str, int]:
    """Return the tokens asked per ``team:model`` in the slots over the window.

    The window is whole slots: the current one (filling) and those back to
    ``now - window_s``.

    Raises:
        redis.RedisError: Redis did not answer.
    """
    last = demand_slot(now, slot_s)
    first = demand_slot(now - window_s, slot_s)
    pipe = client.pipeline(transaction=False)
    for slot in range(first, last + 1):
        pipe.hgetall(demand_slot_key(prefix, slot))
    totals: dict[str, int] = {}
    for raw in pipe.execute():
        for field, tokens in raw.items():
            key = field.decode() if isinstance(field, bytes) else str(field)
            totals[key] = totals.get(key, 0) + int(tokens)
    return totals


def share_region_limits(
    *,
    client: redis.Redis,
    prefix: str,
    region: str,
    now: datetime,
    options: ShareSettings | None = None,
) -> dict[str, float]:
    """Run one tick for ``region`` (see the module docstring); return its shares.

    The shares returned are what was written to Redis: one per key some live
    region asked for, and ``*`` for every other key.

    Raises:
        redis.RedisError: the region's Redis did not answer; nothing published.
        django.db.Error: the control plane did not answer; the shares in Redis
            are left as they were.
    """
    options = options or ShareSettings()
    unix = now.timestamp()
    demand = read_region_demand(
        client,
        prefix=prefix,
        now=unix,
        window_s=options.window_s,
        slot_s=options.slot_s,
    )
    rows = _publish_and_read(region, demand, now, options)
    heard_at: dict[str, float] = {}
    by_key: dict[str, dict[str, float]] = {}
    for row in rows:
        at = row.heard_at.timestamp()
        if row.limit_key == _BEAT_KEY:
            heard_at[row.region] = max(at, heard_at.get(row.region, at))
        elif unix - at <= options.stale_after_s:
            by_key.setdefault(row.limit_key, {})[row.region] = row.demand_tokens

    def share_of(asked: dict[str, float]) -> float:
        return region_shares(
            own_region=region,
            heard_at=heard_at,
            demand=asked,
            now=unix,
            floor=options.floor,
            stale_after_s=options.stale_after_s,
        )[region]

    shares = {key: share_of(asked) for key, asked in sorted(by_key.items())}
    shares[DEFAULT_FIELD] = share_of({})
    pipe = client.pipeline(transaction=True)
    pipe.delete(shares_key(prefix))
    pipe.hset(shares_key(prefix), mapping={k: repr(v) for k, v in shares.items()})
    pipe.execute()
    return shares


def _publish_and_read(
    region: str, demand: dict[str, int], now: datetime, options: ShareSettings
) -> list[RegionDemand]:
    """Upsert the region's rows, drop its keys without demand; return all rows."""
    rows = [
        RegionDemand(
            region=region,
            limit_key=key,
            demand_tokens=tokens,
            window_s=options.window_s,
            heard_at=now,
        )
        for key, tokens in [(_BEAT_KEY, 0), *sorted(demand.items())]
    ]
    with transaction.atomic():
        RegionDemand.objects.bulk_create(
            rows,
            update_conflicts=True,
            unique_fields=["region", "limit_key"],
            update_fields=["demand_tokens", "window_s", "heard_at"],
        )
        RegionDemand.objects.filter(region=region).exclude(
            limit_key__in=[row.limit_key for row in rows]
        ).delete()
    # Rows of regions lost for long are of no use to anyone: keep ten windows.
    horizon = now - timedelta(seconds=10 * max(options.window_s, options.stale_after_s))
    return list(RegionDemand.objects.filter(heard_at__gte=horizon))
