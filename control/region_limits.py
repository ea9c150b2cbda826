"""The live tick of one limit across regions: publish demand, share the limits.

Public surface: ``ShareOptions``, ``share_settings``, ``share_region_limits``,
``read_region_demand``.

Every few seconds each region's beat runs this tick (``control.share_region_limits``),
the pure ``routing.domain.region_shares.share_tick`` driven over Redis and the ORM:

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
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

import redis
from django.conf import settings
from django.db import transaction

from accounts.models import RegionDemand
from routing.domain.region_shares import (
    BEAT_KEY,
    DemandRow,
    PublishDemand,
    ReadDemand,
    ShareOptions,
    WriteShares,
    demand_slot,
    demand_slot_key,
    share_tick,
    shares_key,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ShareOptions",
    "read_region_demand",
    "share_region_limits",
    "share_settings",
]


def share_settings() -> ShareOptions:
    """Return the tick's bounds from Django settings."""
    return ShareOptions(
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
    return _read_slots(
        client,
        prefix,
        ReadDemand(demand_slot(now - window_s, slot_s), demand_slot(now, slot_s)),
    )


def share_region_limits(
    *,
    client: redis.Redis,
    prefix: str,
    region: str,
    now: datetime,
    options: ShareOptions | None = None,
) -> dict[str, float]:
    """Run one tick for ``region`` (see the module docstring); return its shares.

    The pure tick (``routing.domain.region_shares.share_tick``) driven over the
    region's Redis and the control plane.

    Raises:
        redis.RedisError: the region's Redis did not answer; nothing published.
        django.db.Error: the control plane did not answer; the shares in Redis
            are left as they were.
    """
    options = options or ShareOptions()
    tick = share_tick(region=region, now=now.timestamp(), options=options)
    reply: Mapping[str, int] | list[DemandRow] | None = None
    while True:
        try:
            effect = tick.send(reply)
        except StopIteration as done:
            return done.value
        if isinstance(effect, ReadDemand):
            reply = _read_slots(client, prefix, effect)
        elif isinstance(effect, PublishDemand):
            reply = _publish_and_read(effect, options)
        else:
            _write_shares(client, prefix, effect)
            reply = None


def _read_slots(client: redis.Redis, prefix: str, effect: ReadDemand) -> dict[str, int]:
    pipe = client.pipeline(transaction=False)
    for slot in range(effect.first_slot, effect.last_slot + 1):
        pipe.hgetall(demand_slot_key(prefix, slot))
    totals: dict[str, int] = {}
    for raw in pipe.execute():
        for field, tokens in raw.items():
            key = field.decode() if isinstance(field, bytes) else str(field)
            totals[key] = totals.get(key, 0) + int(tokens)
    return totals


def _publish_and_read(effect: PublishDemand, options: ShareOptions) -> list[DemandRow]:
    """Upsert the region's rows, drop its keys without demand; return all rows."""
    heard_at = datetime.fromtimestamp(effect.heard_at, tz=UTC)
    rows = [
        RegionDemand(
            region=effect.region,
            limit_key=key,
            demand_tokens=tokens,
            window_s=options.window_s,
            heard_at=heard_at,
        )
        for key, tokens in [(BEAT_KEY, 0), *sorted(effect.demand.items())]
    ]
    with transaction.atomic():
        RegionDemand.objects.bulk_create(
            rows,
            update_conflicts=True,
            unique_fields=["region", "limit_key"],
            update_fields=["demand_tokens", "window_s", "heard_at"],
        )
        RegionDemand.objects.filter(region=effect.region).exclude(
            limit_key__in=[row.limit_key for row in rows]
        ).delete()
    # Rows of regions lost for long are of no use to anyone: keep ten windows.
    horizon = heard_at - timedelta(
        seconds=10 * max(options.window_s, options.stale_after_s)
    )
    return [
        DemandRow(
            region=row.region,
            limit_key=row.limit_key,
            demand_tokens=row.demand_tokens,
            heard_at=row.heard_at.timestamp(),
        )
        for row in RegionDemand.objects.filter(heard_at__gte=horizon)
    ]


def _write_shares(client: redis.Redis, prefix: str, effect: WriteShares) -> None:
    pipe = client.pipeline(transaction=True)
    pipe.delete(shares_key(prefix))
    pipe.hset(
        shares_key(prefix), mapping={k: repr(v) for k, v in effect.shares.items()}
    )
    pipe.execute()
