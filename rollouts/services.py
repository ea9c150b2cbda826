"""Use-cases for where a model's traffic goes: the alias, shadow and canary rollouts.

The registry holds what exists (models, versions, pools); this app moves traffic
between versions and keeps the rollout history. It depends on the registry, never
the reverse: a model shown with its pending rollout (``model_detail``) is built
here, on top of the registry's ``model_dict``. What the API shows is typed next to
what builds it: ``RolloutOut``, ``ModelDetail``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypedDict

from django.db import transaction
from django.utils import timezone

from config.errors import Conflict, InvalidRequest
from models_registry.domain.gates import traffic_refusal
from models_registry.domain.identity import VersionStatus
from models_registry.models import Model, ModelVersion
from models_registry.services import (
    ModelOut,
    gates_running,
    get_model,
    get_version,
    model_dict,
    status_after_live,
)
from rollouts.domain.plan import (
    DEFAULT_PLAN,
    Decision,
    PlanError,
    Stage,
    parse_plan,
    stage_errors,
)
from rollouts.models import Rollout, VersionOverride

# No override brings back a retired version (its pools are gone). One may send a
# version whose gates have not finished, or that they rejected, to traffic.
_NEVER = frozenset({VersionStatus.RETIRED})


@dataclass(frozen=True, slots=True)
class Override:
    """An admin's explicit override of the version gates for one traffic change."""

    by: str
    reason: str


def admit(
    candidate: ModelVersion,
    *,
    action: str,
    override: Override | None,
    now: datetime,
    stage: str = "",
    percent: float | None = None,
) -> None:
    """Refuse a version that may not take traffic (409), unless overridden.

    An override is recorded (``VersionOverride``) with who, why and what the gates
    would have said. Call inside the traffic change's transaction.
    """
    refusal = traffic_refusal(candidate.ref, candidate.status, candidate.status_reason)
    if refusal is None:
        return
    if candidate.status in _NEVER:
        raise Conflict(refusal, param="version", code="version_out_of_service")
    if gates_running(candidate):
        # Its gates would move it (and could remove its staging replica) under
        # the traffic an override sent it.
        raise Conflict(
            f"{refusal}; its gates are running: wait for them, then override if "
            "you must",
            param="version",
            code="version_not_ready",
        )
    if override is None:
        raise Conflict(
            f"{refusal}; an admin may override with a reason",
            param="version",
            code="version_not_ready",
        )
    if not override.by.strip() or not override.reason.strip():
        raise InvalidRequest(
            "an override needs who and why (override.reason)", param="override.reason"
        )
    VersionOverride.objects.create(
        model_id=candidate.model_id,
        version=candidate,
        action=action,
        stage=stage,
        percent=percent,
        version_status=candidate.status,
        refusal=refusal[:2000],
        by=override.by[:200],
        reason=override.reason[:2000],
        at=now,
    )


def set_rollout(
    *,
    model_id: str,
    version: str,
    stage: str,
    percent: float,
    now: datetime,
    override: Override | None = None,
) -> Rollout:
    """Put ``version`` at ``stage`` for ``percent`` of traffic (seed: PUT .../rollout).

    A canary sets the model's canary version and share, split by conversation id;
    shadow copies requests and clears any canary. A pending rollout of another
    version is superseded; the same stage and share again is a no-op. A version
    that is not ready is refused (409 with the gates' reason) unless ``override``.
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
        pending = Rollout.objects.filter(model=model, decision=Decision.PENDING).first()
        if (
            pending is not None
            and pending.version_id == candidate.pk
            and pending.stage == stage
            and pending.percent == percent
        ):
            return pending
        admit(
            candidate,
            action="rollout",
            override=override,
            now=now,
            stage=stage,
            percent=percent,
        )
        if pending is not None:
            Rollout.objects.filter(pk=pending.pk, decision=Decision.PENDING).update(
                decision=Decision.SUPERSEDED, decided_at=now
            )
        rollout = Rollout.objects.create(
            model=model,
            version=candidate,
            stage=stage,
            percent=percent,
            started_at=now,
            # A stage set by hand takes traffic at once; the guards watch it.
            step_started_at=now,
            previous_version_id=model.live_version_id,
        )
        if stage == Stage.CANARY:
            model.canary_version = candidate
            model.canary_percent = percent
        else:
            model.canary_version = None
            model.canary_percent = 0.0
        model.save(update_fields=["canary_version", "canary_percent", "updated_at"])
    return rollout


def set_alias(
    *, model_id: str, version: str, override: Override | None = None
) -> Model:
    """Point the model name at ``version``: promote a candidate or roll back.

    The previous live version stays registered and loaded (status ``ready``, or
    what its gates said if an override sent it live), so a rollback is this same
    call with the old label. A pending rollout ends: promoted
    if its version is the new alias target, rolled back otherwise. A version that
    is not ready is refused (409 with the gates' reason) unless ``override``.
    """
    with transaction.atomic():
        model = get_model(model_id, for_update=True)
        target = get_version(model_id, version)
        if target.pk != model.live_version_id:
            admit(target, action="alias", override=override, now=timezone.now())
        previous = model.live_version
        if previous is not None and previous.pk != target.pk:
            # Back to what its gates said (an override may have sent it live).
            ModelVersion.objects.filter(pk=previous.pk).update(
                status=status_after_live(previous)
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
        # The alias sent where it points already ends a canary as rolled back:
        # that is the rollback by alias (the canary share goes to zero).
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
    now = timezone.now()
    if pending.version_id == live_version_id:
        # Promoted by hand: the old version is kept for the model's retention,
        # then retired, as after a plan's own promotion.
        model = Model.objects.get(pk=model_id)
        Rollout.objects.filter(pk=pending.pk, decision=Decision.PENDING).update(
            decision=Decision.PROMOTED,
            decided_at=now,
            retire_after=now + timedelta(seconds=_retention_s(model)),
        )
    else:
        Rollout.objects.filter(pk=pending.pk, decision=Decision.PENDING).update(
            decision=Decision.ROLLED_BACK, decided_at=now
        )
    pending.refresh_from_db()
    return pending


def _retention_s(model: Model) -> float:
    """The model's plan's retention (the default plan's for none or a bad one)."""
    try:
        return parse_plan(model.rollout_plan or {}).retention_s
    except PlanError:
        return DEFAULT_PLAN.retention_s


class RolloutOut(TypedDict):
    """A rollout row."""

    id: int
    model: str
    version: str
    stage: str  # a Stage value
    percent: float
    started_at: str  # ISO 8601, as every *_at below
    guard_metrics: dict[str, Any]  # the guards' last readings (JSON)
    decision: str  # a Decision value
    decided_at: str | None
    plan: dict[str, Any] | None  # its RolloutPlan (JSON); None: a stage set by hand
    step: int
    step_started_at: str | None
    paused: bool
    approved_step: int | None
    reason: str
    previous_version: str | None
    retire_after: str | None
    retired_at: str | None


class ModelDetail(ModelOut):
    """A model as the API shows it: the registry's view and its pending rollout."""

    rollout: RolloutOut | None


def model_detail(model_id: str) -> ModelDetail:
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


def rollout_dict(rollout: Rollout) -> RolloutOut:
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
        "plan": rollout.plan,
        "step": rollout.step,
        "step_started_at": _iso(rollout.step_started_at),
        "paused": rollout.paused,
        "approved_step": rollout.approved_step,
        "reason": rollout.reason,
        "previous_version": (
            rollout.previous_version.version if rollout.previous_version else None
        ),
        "retire_after": _iso(rollout.retire_after),
        "retired_at": _iso(rollout.retired_at),
    }


def _iso(at: datetime | None) -> str | None:
    return at.isoformat() if at else None
