"""The gateway's fire-and-forget tasks: usage counts, version figures, shadow copies.

Public surface: ``BackgroundTasks``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["BackgroundTasks"]


class BackgroundTasks:
    """Fire-and-forget tasks of the gateway (usage counts, shadow copies).

    Kept referenced until done (asyncio holds only weak references), failures
    logged, and awaited at shutdown.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` in the background."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    async def drain(self) -> None:
        """Wait for every task still running."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("background task failed: %r", task.exception())
