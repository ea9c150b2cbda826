"""The batch runner's knobs, read from the settings: the scheduler's windows
(``PLATFORM_BATCH_*``) and the batch guard's (``PLATFORM_BATCH_GUARD_*``).

Public surface: ``guard_settings``, ``scheduler_settings``.
"""

from __future__ import annotations

from django.conf import settings

from batches.domain.guard import BatchGuard
from batches.domain.scheduler import SchedulerSettings

__all__ = ["guard_settings", "scheduler_settings"]


def guard_settings() -> BatchGuard:
    """The batch guard's knobs from the settings (``PLATFORM_BATCH_GUARD_*``)."""
    return BatchGuard(
        kv_share=settings.PLATFORM_BATCH_GUARD_KV_SHARE,
        prefill_tokens=settings.PLATFORM_BATCH_GUARD_PREFILL_TOKENS,
        prefill_beside_interactive=(
            settings.PLATFORM_BATCH_GUARD_PREFILL_BESIDE_INTERACTIVE
        ),
        horizon_s=settings.PLATFORM_BATCH_GUARD_HORIZON_S,
        backoff_from=settings.PLATFORM_BATCH_GUARD_BACKOFF_FROM,
        backoff_to=settings.PLATFORM_BATCH_GUARD_BACKOFF_TO,
        raised_share=settings.PLATFORM_BATCH_GUARD_RAISED_SHARE,
    )


def scheduler_settings() -> SchedulerSettings:
    """The batch scheduler's windows from the settings (``PLATFORM_BATCH_*``)."""
    return SchedulerSettings(
        initial_window=min(
            settings.PLATFORM_BATCH_INITIAL_WINDOW, settings.PLATFORM_BATCH_MAX_WINDOW
        ),
        max_window=settings.PLATFORM_BATCH_MAX_WINDOW,
        min_observed_s=settings.PLATFORM_BATCH_MIN_OBSERVED_S,
        rate_window_s=settings.PLATFORM_BATCH_RATE_WINDOW_S,
    )
