"""The live-load shares gateway processes publish through Redis: key names and sums.

Public surface: ``gateway_load_key``, ``gateways_seen_key``, ``pool_key``,
``team_key``, ``batch_key``, ``queue_tokens_key``, ``queue_depth_key``, ``admitted_key``,
``prefill_key``, ``PoolLoad``, ``sum_pool_load``, ``sum_replica_tokens``,
``pool_admitted``.

Each gateway process of a region writes its share (``routing.live.LiveLoad.own``)
as a Redis hash under ``<prefix>:load:<region>:<gateway_id>`` once a second, and
lists itself in the sorted set ``<prefix>:gateways-seen:<region>``, scored by the
unix time of its exchange. A share maps keys to integers: a replica id to the
tokens this process has in flight on it, ``p|model|version`` to the tokens it
admitted into the pool, ``t|model|version|team`` to a team's part of those,
``b|model|version`` to the batch tier's part of those (admission's batch lane), and
``q|model|version`` / ``qn|model|version`` to the tokens and requests waiting in
its admission queue for the pool, and ``a|model|version`` to the tokens it has
admitted into the pool since it started (a count that only grows: the
autoscaler's rate of an embedding pool's input tokens, ``pool_admitted``), and
``f|replica`` to the prompt tokens this process's requests on a replica still
wait to have prefilled (cache-aware routing's queue estimate). The gateways read each other's shares (routing
and admission); the autoscaler sums them per pool (``sum_pool_load``).

The layout lives here, below both the gateway (``routing``) and the autoscaler
(``control.autoscaling``), so that writer and reader cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "PoolLoad",
    "admitted_key",
    "batch_key",
    "gateway_load_key",
    "gateways_seen_key",
    "pool_admitted",
    "pool_key",
    "prefill_key",
    "queue_depth_key",
    "queue_tokens_key",
    "sum_pool_load",
    "sum_replica_tokens",
    "team_key",
]


def gateway_load_key(prefix: str, region: str, gateway_id: str) -> str:
    """Return the Redis key of one gateway process's share."""
    return f"{prefix}:load:{region}:{gateway_id}"


def gateways_seen_key(prefix: str, region: str) -> str:
    """Return the Redis key of the region's gateway processes, scored by last exchange."""
    return f"{prefix}:gateways-seen:{region}"


def pool_key(model: str, version: str) -> str:
    """Return the share key of a pool's admitted tokens."""
    return f"p|{model}|{version}"


def prefill_key(replica_id: str) -> str:
    """Return the share key of the prompt tokens a replica still owes in prefill."""
    return f"f|{replica_id}"


def team_key(model: str, version: str, team: str) -> str:
    """Return the share key of a team's admitted tokens in a pool."""
    return f"t|{model}|{version}|{team}"


def batch_key(model: str, version: str) -> str:
    """Return the share key of the batch tier's admitted tokens in a pool."""
    return f"b|{model}|{version}"


def queue_tokens_key(model: str, version: str) -> str:
    """Return the share key of the tokens waiting in a pool's admission queue."""
    return f"q|{model}|{version}"


def admitted_key(model: str, version: str) -> str:
    """Return the share key of the tokens admitted into a pool since the process
    started (cumulative)."""
    return f"a|{model}|{version}"


def queue_depth_key(model: str, version: str) -> str:
    """Return the share key of the requests waiting in a pool's admission queue."""
    return f"qn|{model}|{version}"


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """A pool's load summed over gateway processes."""

    tokens_in_flight: int = 0
    queued_tokens: int = 0
    queue_depth: int = 0


def sum_pool_load(
    shares: Iterable[Mapping[str, int]], model: str, version: str
) -> PoolLoad:
    """Return the pool's admitted tokens, queued tokens and queued requests over
    ``shares`` (each gateway's, decoded); missing keys count as zero."""
    admitted, queued, depth = (
        pool_key(model, version),
        queue_tokens_key(model, version),
        queue_depth_key(model, version),
    )
    tokens_in_flight = queued_tokens = queue_depth = 0
    for share in shares:
        tokens_in_flight += max(0, share.get(admitted, 0))
        queued_tokens += max(0, share.get(queued, 0))
        queue_depth += max(0, share.get(depth, 0))
    return PoolLoad(tokens_in_flight, queued_tokens, queue_depth)


def sum_replica_tokens(
    shares: Iterable[Mapping[str, int]], replica_ids: Iterable[str]
) -> int:
    """Return the tokens in flight on ``replica_ids`` as the routers count them
    (prompt plus remaining output of their open requests), over ``shares``."""
    ids = set(replica_ids)
    return sum(max(0, share.get(rid, 0)) for share in shares for rid in ids)


def pool_admitted(
    shares: Mapping[str, Mapping[str, int]], model: str, version: str
) -> dict[str, int]:
    """Return each gateway process's count of tokens admitted into the pool since
    it started, from ``shares`` (gateway process id to its decoded share); a
    process that has admitted none is absent."""
    key = admitted_key(model, version)
    return {
        gateway_id: share[key]
        for gateway_id, share in shares.items()
        if share.get(key, 0) > 0
    }
