"""Celery tasks of batches: the dispatcher (beat) and one runner slice (queue
``batches``)."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from batches import runner

# A slice ends by waiting for its lines in flight (each bounded by the request
# timeout), so the task's limits leave room for that.
_SOFT_LIMIT_S = int(
    settings.PLATFORM_BATCH_SLICE_S + settings.PLATFORM_BATCH_REQUEST_TIMEOUT_S + 60
)


@shared_task(name="batches.dispatch_batches")
def dispatch_batches() -> dict[str, int]:
    """Hand each active batch nobody holds to a runner; end what must end."""
    return runner.dispatch()


@shared_task(
    name="batches.run_batch",
    soft_time_limit=_SOFT_LIMIT_S,
    time_limit=_SOFT_LIMIT_S + 30,
)
def run_batch(batch_id: str) -> str:
    """Work one slice of a batch; when it goes on, queue the next slice at once."""
    outcome = runner.run_batch(batch_id)
    if outcome is runner.Outcome.CONTINUE:
        runner.hand_on(batch_id)
    return outcome.value
