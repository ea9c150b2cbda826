"""The gateway's side of one limit across regions: demand out, shares in.

Public surface: ``RegionLimits``.

Each charge the gateway asks of a team's bucket (admitted or refused) is added
here in memory (``note``); once a second, with the live-load exchange, the tokens
noted since are added to the region's demand slot in Redis and the region's shares
are read back (``exchange``: one pipeline, never a call per request). Admission
then sizes the team's bucket by ``share`` (``routing.domain.region_shares``).

The shares stay as last read while Redis or the control plane is away; before any
share was written (one region, or the first seconds) a team has its whole limit.
This module is async-side code: it imports no models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from routing.domain.region_shares import (
    DEFAULT_FIELD,
    demand_slot,
    demand_slot_key,
    shares_key,
)

logger = logging.getLogger(__name__)

__all__ = ["RegionLimits"]


class RegionLimits:
    """This process's unsent demand per ``team:model``, and the region's shares."""

    def __init__(
        self,
        *,
        redis: Any | None,
        prefix: str,
        slot_s: float,
        slot_ttl_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.slot_s = slot_s
        self.slot_ttl_ms = max(1, round(slot_ttl_s * 1000))
        self.clock = clock
        self.shares: dict[str, float] = {}
        self._unsent: dict[str, int] = {}

    def note(self, key: str, tokens: int) -> None:
        """Count a charge of ``tokens`` asked of ``key``'s bucket here."""
        if tokens > 0:
            self._unsent[key] = self._unsent.get(key, 0) + tokens

    def share(self, key: str) -> float:
        """Return this region's share of ``key``'s limits (1: all of them)."""
        share = self.shares.get(key)
        if share is None:
            share = self.shares.get(DEFAULT_FIELD, 1.0)
        return share

    async def exchange(self) -> None:
        """Send the demand noted since the last exchange; read the shares.

        Raises:
            Exception: what Redis raised; the unsent demand is kept for the next
                exchange and the shares stay as last read.
        """
        if self.redis is None:
            return
        unsent, self._unsent = self._unsent, {}
        key = demand_slot_key(self.prefix, demand_slot(self.clock(), self.slot_s))
        pipe = self.redis.pipeline(transaction=False)
        for field, tokens in unsent.items():
            pipe.hincrby(key, field, tokens)
        if unsent:
            pipe.pexpire(key, self.slot_ttl_ms)
        pipe.hgetall(shares_key(self.prefix))
        try:
            results = await pipe.execute()
        except Exception:
            # Not sent (or not known to be): counted again next time. Demand is a
            # weight, not a bill, so a rare double count is harmless.
            for field, tokens in unsent.items():
                self._unsent[field] = self._unsent.get(field, 0) + tokens
            raise
        self.shares = _decode_shares(results[-1])


def _decode_shares(raw: dict[Any, Any]) -> dict[str, float]:
    shares: dict[str, float] = {}
    for field, value in raw.items():
        name = field.decode() if isinstance(field, bytes) else str(field)
        try:
            shares[name] = float(value)
        except ValueError:
            logger.warning("limit share %s is not a number", name)
    return shares
