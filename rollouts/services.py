"""Use-cases for where a model's traffic goes: the alias, shadow and canary rollouts.

The registry holds what exists (models, versions, pools); this app moves traffic
between versions and keeps the rollout history. It depends on the registry, never
the reverse: a model shown with its pending rollout (``model_detail``) is built
here, on top of the registry's ``model_dict``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from config.errors import Conflict, InvalidRequest
from models_registry.domain.identity import VersionStatus
from models_registry.models import Model, ModelVersion
from models_registry.services import get_model, get_version, model_dict
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
    errors = stage_errors(stage, percent)
    if errors:
        param, message = errors[0]
        raise InvalidRequest(f"{param} {message}", param=param)
    with transaction.atomic():
        model = get_model(model_id, for_update=True)
        candidate = get_version(model_id, version)
        # 409s, not 400s: the body is valid; the version's state refuses it.
        if candidate.pk == model.live_version_id:
            raise Conflict(
                f"{candidate.ref} is already live; a rollout needs another version",
                param="version",
                code="version_is_live",
            )
        if candidate.status in {VersionStatus.REJECTED, VersionStatus.RETIRED}:
            raise Conflict(
                f"{candidate.ref} is {candidate.status} and cannot take traffic",
                param="version",
                code="version_out_of_service",
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


def set_alias(*, model_id: str, version: str) -> Model:
    """Point the model name at ``version``: promote a candidate or roll back.

    The previous live version stays registered and loaded (status ``ready``), so a
    rollback is this same call with the old label. A pending rollout ends: promoted
    if its version is the new alias target, rolled back otherwise.
    """
    with transaction.atomic():
        model = get_model(model_id, for_update=True)
        target = get_version(model_id, version)
        if target.status in {VersionStatus.REJECTED, VersionStatus.RETIRED}:
            raise Conflict(
                f"{target.ref} is {target.status} and cannot take traffic",
                param="version",
                code="version_out_of_service",
            )
        previous_id = model.live_version_id
        if previous_id is not None and previous_id != target.pk:
            ModelVersion.objects.filter(pk=previous_id).update(
                status=VersionStatus.READY
            )
        ModelVersion.objects.filter(pk=target.pk).update(status=VersionStatus.LIVE)
        model.live_version = target
        model.canary_version = None
        model.canary_percent = 0.0
        model.save(
            update_fields=[
                "live_version",
                "canary_version",
                "canary_percent",
                "updated_at",
            ]
        )
        end_pending_rollout(model_id=model_id, live_version_id=target.pk)
    return model


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


def model_detail(model_id: str) -> dict[str, Any]:
    """Return a model as the API shows it: the registry's view plus its pending rollout.

    Raises NotFound for an unknown model.
    """
    model = get_model(model_id)
    pending = (
        Rollout.objects.filter(model=model, decision=Decision.PENDING)
        .select_related("version")
        .first()
    )
    return {
        **model_dict(model),
        "rollout": rollout_dict(pending) if pending else None,
    }


def rollout_dict(rollout: Rollout) -> dict[str, Any]:
    """Return a rollout row as the API shows it."""
    return {
        "id": rollout.pk,
        "model": rollout.model_id,
        "version": rollout.version.version,
        "stage": rollout.stage,
        "percent": rollout.percent,
        "started_at": rollout.started_at.isoformat(),
        "guard_metrics": rollout.guard_metrics,
        "decision": rollout.decision,
        "decided_at": rollout.decided_at.isoformat() if rollout.decided_at else None,
    }
