"""Which team keys this gateway process has seen, written to ``last_used_at`` in batches.

Public surface: ``KeyUses``.

Authentication reads keys from the snapshot and never the database, so the use of a
key is noted in memory (a set add per request) and a background job of the gateway
writes the keys seen since the last write with one UPDATE, every
``PLATFORM_KEY_LAST_USED_FLUSH_S``, and once more when the process stops. The set
is bounded by the number of active keys, since only keys that authenticated are
noted. ``last_used_at`` is therefore the time of the write, up to one interval after
the key's last request; a failed write keeps the ids for the next one.

While the database is down every write fails: the ids wait in memory, one warning
names the outage (the error's type, never key material) and one line says when
writes resume, instead of a traceback every interval.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

__all__ = ["KeyUses"]

logger = logging.getLogger(__name__)


class KeyUses:
    """The ids of the keys used since the last successful ``flush``."""

    __slots__ = ("_is_failing", "_seen", "_write")

    def __init__(self, write: Callable[[frozenset[int]], Awaitable[object]]) -> None:
        self._write = write
        self._seen: set[int] = set()
        self._is_failing = False

    def note(self, key_id: int) -> None:
        """Remember that ``key_id`` opened a request (no I/O)."""
        self._seen.add(key_id)

    async def flush(self) -> None:
        """Write the keys seen since the last flush; keep them if the write fails.

        A failed write is logged once per outage and not raised, so the gateway's
        loop does not log a traceback each interval while the database is down.
        """
        if not self._seen:
            return
        batch = frozenset(self._seen)
        self._seen.clear()
        try:
            await self._write(batch)
        except Exception as exc:
            # Requests noted during the failed write are in _seen already.
            self._seen |= batch
            if not self._is_failing:
                self._is_failing = True
                logger.warning(
                    "writing key last-used times failed (%s); %d keys wait",
                    type(exc).__name__,
                    len(self._seen),
                )
        except BaseException:
            self._seen |= batch
            raise
        else:
            if self._is_failing:
                self._is_failing = False
                logger.info("writing key last-used times resumed")
