"""A pool's traffic-twin setting: the share of its conversations the gateways
record (``Pool.record_traffic_share``; ``routing.domain.traffic``), read and set
by ``GET`` / ``PUT /admin/pools/{model}/{version}/{region}/traffic``.

Public surface: ``TrafficOut``, ``pool_traffic``, ``set_pool_traffic``.

The gateways read the share from their config snapshot, so a change reaches them
at its next refresh (``PLATFORM_SNAPSHOT_REFRESH_S``). Records keep no text; see
docs/platform-admins.md for what is kept and for how long.
"""

from __future__ import annotations

from typing import TypedDict

from django.db import transaction

from models_registry.models import Pool
from models_registry.pools import get_pool

__all__ = ["TrafficOut", "pool_traffic", "set_pool_traffic"]


class TrafficOut(TypedDict):
    """A pool and the share of its conversations recorded (0: none)."""

    model: str
    version: str
    region: str
    record_traffic_share: float


def _out(pool: Pool) -> TrafficOut:
    return {
        "model": pool.model_id,
        "version": pool.version.version,
        "region": pool.region,
        "record_traffic_share": pool.record_traffic_share,
    }


def pool_traffic(*, model_id: str, version: str, region: str) -> TrafficOut:
    """Return the pool's traffic-twin setting.

    Raises:
        NotFound: no such model, or no such pool.
    """
    return _out(get_pool(model_id=model_id, version=version, region=region))


def set_pool_traffic(
    *, model_id: str, version: str, region: str, share: float
) -> TrafficOut:
    """Set the share of the pool's conversations recorded (0 to 1, checked by the
    caller's serializer and the table's constraint).

    Raises:
        NotFound: no such model, or no such pool.
    """
    with transaction.atomic():
        pool = get_pool(
            model_id=model_id, version=version, region=region, for_update=True
        )
        pool.record_traffic_share = share
        pool.save(update_fields=["record_traffic_share"])
    return _out(pool)
