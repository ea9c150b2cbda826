"""One engine's ``/metrics`` scrape, and the load a beat carries from it.

Shared by the node agent and the Kubernetes beat loop, so both beat the same
figures from the same parse (``engine_nodes.domain.scrape``).
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from engine_nodes.domain.scrape import EngineStats, parse_metrics_text

__all__ = ["beat_load", "scrape_engine"]

logger = logging.getLogger(__name__)


def scrape_engine(http: httpx.Client, url: str) -> EngineStats | None:
    """Return the stats of the engine at ``url``; None if it did not answer well.

    The client's timeout bounds the call.
    """
    try:
        response = http.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse_metrics_text(response.text)
    except ValueError:
        logger.warning("unparseable /metrics from %s", url)
        return None


def beat_load(stats: EngineStats | None) -> dict[str, Any]:
    """Return a beat's load fields from a scrape (zeros without one)."""
    return {
        "queue_depth": stats.queue_depth if stats else 0,
        "num_running": stats.num_requests_running if stats else 0,
        "tokens_in_flight": stats.kv_tokens_in_use if stats else 0,
        "kv_cache_usage_perc": stats.kv_cache_usage_perc if stats else 0.0,
    }
