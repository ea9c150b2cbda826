"""Batches running and at risk of missing their deadline, per model, for /metrics.

Public surface: ``batch_figures``.

Read at scrape time (``metering.metrics.BatchCollector``, registered in
``batches.apps``), one query per scrape: the runners write the scheduler's
judgement (``Batch.at_risk``) to the database, and they are not scraped.
"""

from __future__ import annotations

from django.db.models import Count, Q

from batches.models import Batch
from metering.metrics import BatchFigures

__all__ = ["batch_figures"]

# Batches that have not ended. Cancelling is on its way out: its deadline no
# longer matters.
_ACTIVE = (
    Batch.Status.VALIDATING,
    Batch.Status.IN_PROGRESS,
    Batch.Status.FINALIZING,
)


def batch_figures() -> list[BatchFigures]:
    """Return, per model with a batch not ended, its active and at-risk batches.

    Only batches in progress count as at risk: the flag is the scheduler's last
    judgement while lines were being sent, and a finalising batch has sent them.
    """
    rows = (
        Batch.objects.filter(status__in=_ACTIVE)
        .values("model_id")
        .annotate(
            active=Count("id"),
            at_risk=Count(
                "id", filter=Q(status=Batch.Status.IN_PROGRESS, at_risk=True)
            ),
        )
        .order_by("model_id")
    )
    return [
        BatchFigures(
            model=row["model_id"], active=row["active"], at_risk=row["at_risk"]
        )
        for row in rows
    ]
