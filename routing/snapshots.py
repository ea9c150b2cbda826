"""The gateway's copy of the control plane: the last snapshot, refreshed in the background.

Public surface: ``SnapshotHolder``.

The hot path reads ``SnapshotHolder.current`` and never the database. A refresh that
fails (the database is down) keeps the last snapshot and marks the control plane
unreachable; a gateway that started with the database down has no snapshot, says
so in ``/healthz`` and its metrics, and serves from the first refresh that works.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from metering import metrics
from routing.domain.snapshot import ConfigSnapshot
from routing.prompt_tokens import VersionCounters

logger = logging.getLogger(__name__)

__all__ = ["SnapshotHolder"]


class SnapshotHolder:
    """The last snapshot that loaded, when it loaded, and whether the last try did.

    ``refresh`` is the only writer. ``prompt_counters`` starts loading each new
    version's tokenizer as soon as a snapshot names it.
    """

    def __init__(
        self,
        load: Callable[[], Awaitable[ConfigSnapshot]],
        *,
        prompt_counters: VersionCounters,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._load = load
        self.prompt_counters = prompt_counters
        self._clock = clock
        self.current: ConfigSnapshot | None = None
        self.loaded_at = 0.0  # clock time of the last successful refresh
        self.control_plane_up = False
        self._has_failed = False  # warn once per outage, not on every refresh

    def age_s(self) -> float | None:
        """Seconds since the last successful refresh, None if none ever succeeded."""
        if self.current is None:
            return None
        return self._clock() - self.loaded_at

    async def refresh(self) -> None:
        """Swap in a fresh snapshot; on failure keep serving the last one."""
        try:
            snapshot = await self._load()
        except Exception as exc:
            if self.control_plane_up or not self._has_failed:
                logger.warning(
                    "control plane unreachable, serving the last snapshot: %s",
                    type(exc).__name__,
                )
            self.control_plane_up = False
            self._has_failed = True
            metrics.set_control_plane(up=False, snapshot_age_s=self.age_s())
            return
        self.current = snapshot
        self.loaded_at = self._clock()
        self.prompt_counters.prepare(snapshot.versions.values())
        if not self.control_plane_up:
            logger.info(
                "control plane snapshot loaded (%d models, %d replicas)",
                len(snapshot.models),
                len(snapshot.replicas),
            )
        self.control_plane_up = True
        self._has_failed = False
        metrics.set_control_plane(up=True, snapshot_age_s=0.0)
