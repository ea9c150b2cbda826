"""One gateway process's share of a team's limits, while the shared limiter is away.

Public surface: ``LocalLimits``, ``local_share``.

With Redis, a team's token bucket and concurrency cap on a model are shared by every
gateway process of the region. When Redis is unreachable each process enforces its
limits alone (``routing.failover``), over ``gateways`` processes: the number it last
saw in the region. Each takes an equal part, rounded down, so that together they
stay within the team's limits whatever process a request lands on:

- the bucket refills at ``refill_per_s / gateways``, and holds
  ``capacity // gateways`` tokens, or the request's whole charge if that is more
  (at most ``capacity``): a request the team's limit allows stays admissible, once
  a full local bucket can hold it, instead of becoming a 400. This lets each
  process burst one such request above its part, once per refill; over an outage
  the region's rate still stays at the team's;
- the concurrency cap is ``max_concurrency // gateways``, at least 1, so a team can
  still be served by every process (a cap below the number of processes is
  exceeded, by at most one stream per process).

Limits that the stores would refuse (a capacity, rate or cap that is not positive)
are returned unchanged, so they are refused with the same error as with Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LocalLimits", "local_share"]


@dataclass(frozen=True, slots=True)
class LocalLimits:
    """The limits one process enforces on a team's bucket and slots."""

    capacity: int
    refill_per_s: float
    max_concurrency: int


def local_share(
    *,
    capacity: int,
    refill_per_s: float,
    max_concurrency: int,
    amount: int,
    gateways: int,
) -> LocalLimits:
    """Return one of ``gateways`` processes' share of the limits, charging ``amount``.

    Raises:
        ValueError: ``gateways`` is less than 1.
    """
    if gateways < 1:
        raise ValueError("gateways must be 1 or more")
    if gateways == 1 or capacity <= 0 or refill_per_s <= 0:
        return LocalLimits(capacity, refill_per_s, max_concurrency)
    tokens = max(capacity // gateways, min(amount, capacity), 1)
    slots = (
        max(1, max_concurrency // gateways) if max_concurrency > 0 else max_concurrency
    )
    return LocalLimits(
        capacity=tokens, refill_per_s=refill_per_s / gateways, max_concurrency=slots
    )
