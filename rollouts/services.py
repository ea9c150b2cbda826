"""Use-cases for rollouts: put a candidate version in shadow or canary, end rollouts."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from config.errors import InvalidRequest
from models_registry.domain.identity import VersionStatus
from rollouts.domain.plan import Decision, Stage, stage_errors
from rollouts.models import Rollout


def set_rollout(
    *, model_id: str, version: str, stage: str, percent: float, now: datetime
) -> Rollout:
    """Put ``version`` at ``stage`` for ``percent`` of traffic (seed: PUT .../rollout).

    A canary sets the model's canary version and share, split by conversation id;
    shadow copies requests and clears any canary. A pending rollout of another
    version is superseded; the same stage and share again is a no-op.
    """
    from models_registry.services import get_model, get_version

    errors = stage_errors(stage, percent)
    if errors:
        param, message = errors[0]
        raise InvalidRequest(f"{param} {message}", param=param)
    with transaction.atomic():
        model = get_model(model_id, for_update=True)
        candidate = get_version(model_id, version)
        if candidate.pk == model.live_version_id:
            raise InvalidRequest(
                f"{candidate.ref} is already live; a rollout needs another version",
                param="version",
            )
        if candidate.status in {VersionStatus.REJECTED, VersionStatus.RETIRED}:
            raise InvalidRequest(
                f"{candidate.ref} is {candidate.status} and cannot take traffic",
                param="version",
            )
        pending = Rollout.objects.filter(model=model, decision=Decision.PENDING).first()
        if (
            pending is not None
            and pending.version_id == candidate.pk
            and pending.stage == stage
            and pending.percent == percent
        ):
            return pending
        if pending is not None:
            Rollout.objects.filter(pk=pending.pk, decision=Decision.PENDING).update(
                decision=Decision.SUPERSEDED, decided_at=now
            )
        rollout = Rollout.objects.create(
            model=model, version=candidate, stage=stage, percent=percent, started_at=now
        )
        if stage == Stage.CANARY:
            model.canary_version = candidate
            model.canary_percent = percent
        else:
            model.canary_version = None
            model.canary_percent = 0.0
        model.save(update_fields=["canary_version", "canary_percent", "updated_at"])
    return rollout


def end_pending_rollout(*, model_id: str, live_version_id: int) -> Rollout | None:
    """End the model's pending rollout after an alias change; return it, if any.

    Promoted when the alias now points at the rollout's version, rolled back when it
    points anywhere else. Call inside the alias change's transaction.
    """
    pending = Rollout.objects.filter(
        model_id=model_id, decision=Decision.PENDING
    ).first()
    if pending is None:
        return None
    decision = (
        Decision.PROMOTED
        if pending.version_id == live_version_id
        else Decision.ROLLED_BACK
    )
    Rollout.objects.filter(pk=pending.pk, decision=Decision.PENDING).update(
        decision=decision, decided_at=timezone.now()
    )
    pending.refresh_from_db()
    return pending
