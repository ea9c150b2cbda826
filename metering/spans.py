"""The replicas' state history (``metering.models.ReplicaSpan``), written as they move.

Public surface: ``SpanStart``, ``record_moves``, ``close_spans``, ``spans_between``.

``engine_nodes.models.Replica`` calls ``record_moves`` inside the transaction that
creates a replica, changes its state or deletes it, so the history cannot miss a
move or record one that was rolled back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db.models import F, Q, Value
from django.db.models.functions import Greatest

from metering.domain.cost import Span
from metering.models import ReplicaSpan

__all__ = ["SpanStart", "close_spans", "record_moves", "spans_between"]

_GONE = "gone"


@dataclass(frozen=True, slots=True)
class SpanStart:
    """A replica entering ``state`` (version is the label, gpus per replica)."""

    replica_id: str
    model: str
    version: str
    region: str
    gpus: int
    state: str


def close_spans(replica_ids: Iterable[str], *, at: datetime) -> int:
    """End the open span of each replica at ``at``; return how many ended.

    The processes that move a replica (its agent, the reaper, the console) read
    their own clocks: a span is never ended before it began, however they disagree.
    """
    ids = list(replica_ids)
    if not ids:
        return 0
    return ReplicaSpan.objects.filter(replica_id__in=ids, ended_at__isnull=True).update(
        ended_at=Greatest(F("started_at"), Value(at))
    )


def record_moves(moves: Sequence[SpanStart], *, at: datetime) -> None:
    """Close each replica's open span and open one in its new state (none if gone).

    The new span starts where the old one ended: at ``at``, or at the old span's
    start when this process's clock is behind the one that opened it.
    """
    if not moves:
        return
    ids = [m.replica_id for m in moves]
    opened = dict(
        ReplicaSpan.objects.filter(
            replica_id__in=ids, ended_at__isnull=True
        ).values_list("replica_id", "started_at")
    )
    close_spans(ids, at=at)
    ReplicaSpan.objects.bulk_create(
        ReplicaSpan(
            replica_id=m.replica_id,
            model=m.model,
            version=m.version,
            region=m.region,
            gpus=m.gpus,
            state=m.state,
            started_at=max(at, opened.get(m.replica_id, at)),
        )
        for m in moves
        if m.state != _GONE
    )


def spans_between(start: datetime, end: datetime) -> list[Span]:
    """Return the spans that overlap ``[start, end)``, as the cost model takes them."""
    rows = ReplicaSpan.objects.filter(
        Q(ended_at__isnull=True) | Q(ended_at__gt=start), started_at__lt=end
    ).values_list(
        "model", "version", "region", "gpus", "state", "started_at", "ended_at"
    )
    return [Span(*row) for row in rows]
