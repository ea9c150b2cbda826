"""Open rollouts and the guards' trips, for /metrics.

Public surface: ``rollout_figures``.

Read at scrape time (``metering.metrics.RolloutCollector``, registered in
``rollouts.apps``), two queries per scrape: the guard task runs in the Celery
worker, which nobody scrapes, and its evaluations live in the database.
"""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count, Max, Q

from metering.metrics import GuardTrips, OpenRollout
from rollouts.domain.plan import Decision, GuardAction
from rollouts.models import Rollout

__all__ = ["rollout_figures"]


def rollout_figures() -> Iterator[OpenRollout | GuardTrips]:
    """Yield every pending rollout, then every rolled-out version's guard trips.

    A trip is a guard evaluation whose action was ``roll_back``. Each version that
    ever had a rollout is counted, at 0 before its first trip, so that the trips
    counter exists before it first moves (``increase`` cannot see a series'
    first sample). Versions are few: the labels stay bounded.
    """
    pending = Rollout.objects.filter(decision=Decision.PENDING.value).select_related(
        "version"
    )
    for rollout in pending:
        yield OpenRollout(
            model=rollout.model_id,
            version=rollout.version.version,
            stage=rollout.stage,
            percent=rollout.percent,
            is_paused=rollout.paused,
        )
    tripped = Q(evaluations__action=GuardAction.ROLL_BACK.value)
    per_version = (
        Rollout.objects.values("model_id", "version__version")
        .annotate(
            trips=Count("evaluations", filter=tripped),
            last_trip_at=Max("evaluations__at", filter=tripped),
        )
        .order_by("model_id", "version__version")
    )
    for row in per_version:
        last = row["last_trip_at"]
        yield GuardTrips(
            model=row["model_id"],
            version=row["version__version"],
            trips=row["trips"],
            last_trip_at=None if last is None else last.timestamp(),
        )
