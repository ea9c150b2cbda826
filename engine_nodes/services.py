"""Use-cases for replicas: heartbeats and the reaper."""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.db.models import Q

from engine_nodes.domain.liveness import ReplicaState, silence_cutoff
from engine_nodes.models import Replica

logger = logging.getLogger(__name__)


def reap_silent_replicas(*, now: datetime) -> list[str]:
    """Mark replicas gone that missed ``PLATFORM_MISSED_BEATS`` heartbeats; return their ids.

    A replica that never beat is judged by its creation time, so one that dies while
    starting is reaped too. The update is a compare-and-set on the same condition:
    a replica whose heartbeat lands between the read and the write is left alone.
    """
    cutoff = silence_cutoff(
        now, settings.PLATFORM_HEARTBEAT_S, settings.PLATFORM_MISSED_BEATS
    )
    silent = Replica.objects.live().filter(
        Q(last_heartbeat__lt=cutoff)
        | Q(last_heartbeat__isnull=True, created_at__lt=cutoff)
    )
    reaped = []
    for replica_id in list(silent.values_list("replica_id", flat=True)):
        updated = silent.filter(replica_id=replica_id).update(state=ReplicaState.GONE)
        if updated == 1:
            reaped.append(replica_id)
    if reaped:
        logger.info("reaped %d silent replicas: %s", len(reaped), ", ".join(reaped))
    return reaped
