"""Shadow traffic: a copy of a request sent to the version under test, answer discarded.

Public surface: ``Shadow``.

A shadow copy never touches the caller's stream and never queues: when
``concurrency`` copies are in flight, further ones are skipped. Its outcome and
time to first token are recorded per version (``platform_shadow_*``), so a
rollout can compare the shadow with the live version before any user sees it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from metering import metrics
from routing.domain.snapshot import ConfigSnapshot
from routing.live import LiveLoad
from routing.upstream import Upstream

__all__ = ["Shadow"]


class Shadow:
    """Send shadow copies to the least loaded replica of the shadow version."""

    def __init__(
        self,
        *,
        live: LiveLoad,
        upstream: Upstream,
        region: str,
        concurrency: int,
    ) -> None:
        self.live = live
        self.upstream = upstream
        self.region = region
        self._slots = asyncio.Semaphore(concurrency)

    async def copy(
        self,
        snapshot: ConfigSnapshot,
        *,
        model: str,
        version: str,
        payload: bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Send ``payload`` to ``model@version``; read and discard the answer."""
        if self._slots.locked() or not self.upstream.is_open:
            return  # shadows never queue behind each other or the caller
        async with self._slots:
            nodes = self.live.nodes(snapshot, model, version, clock())
            if not nodes:
                return
            node = min(nodes, key=lambda n: n.tokens_in_flight)
            started = clock()
            first: float | None = None
            outcome = "ok"
            try:
                async with await self.upstream.chat(node.url, payload) as response:
                    async for _ in response.content.iter_any():
                        if first is None:
                            first = clock()
                    if response.status != 200:
                        outcome = "error"
            except (TimeoutError, aiohttp.ClientError, OSError):
                outcome = "error"
                first = None
            metrics.observe_shadow(
                model=model,
                version=version,
                region=self.region,
                outcome=outcome,
                ttft_s=(first - started) if first is not None else None,
            )
