"""Which team keys this gateway process has seen, written to ``last_used_at`` in batches.

Public surface: ``KeyUses``.

Authentication reads keys from the snapshot and never the database, so the use of a
key is noted in memory (a set add per request) and a background job of the gateway
writes the keys seen since the last write with one UPDATE, every
``PLATFORM_KEY_LAST_USED_FLUSH_S``, and once more when the process stops. The set
is bounded by the number of active keys, since only keys that authenticated are
noted. ``last_used_at`` is therefore the time of the write, up to one interval after
the key's last request; a failed write keeps the ids for the next one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

__all__ = ["KeyUses"]


class KeyUses:
    """The ids of the keys used since the last successful ``flush``."""

    __slots__ = ("_seen", "_write")

    def __init__(self, write: Callable[[frozenset[int]], Awaitable[object]]) -> None:
        self._write = write
        self._seen: set[int] = set()

    def note(self, key_id: int) -> None:
        """Remember that ``key_id`` opened a request (no I/O)."""
        self._seen.add(key_id)

    async def flush(self) -> None:
        """Write the keys seen since the last flush; keep them if the write fails."""
        if not self._seen:
            return
        batch = frozenset(self._seen)
        self._seen.clear()
        try:
            await self._write(batch)
        except BaseException:
            # Requests noted during the failed write are in _seen already.
            self._seen |= batch
            raise
