"""Rollout plans as a service: start, begin a step, end, admin controls, retention.

The guard tick that judges a begun step lives with the other control loops
(``control.rollout_guard``, on the pure ``rollouts.domain.guard_tick``); this
module holds the writes it shares with them and with the admins:

- ``start_plan``: the candidate's first step, and its pools beside the live ones
  (``ensure_candidate_pools``); a step takes traffic only once the candidate has
  a serving replica in every region where its pool is (``begin_step``, called by
  the guard task with what the node agents report): a canary share sent to a
  pool still starting would fail its conversations;
- ``apply_traffic``: the model's canary fields for a step (raising a canary's
  percent only moves conversations onto it, never back);
- ``end_rollout``: the canary share goes to zero (one change: the alias still
  points at the old version, which never stopped serving); a rollback also
  rejects the candidate, whose pools the guard task then releases;
- ``control``, ``abort_waiting``: an admin's pause, resume, approve or abort, and
  the guards' abort of a candidate that never served;
- ``retire_expired``: the old version after a promotion's retention.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.db import transaction

from config.errors import Conflict, InvalidRequest, NotFound
from models_registry.domain.identity import VersionStatus
from models_registry.models import Model, ModelKind, ModelVersion, Pool
from models_registry.services import get_model, get_version
from rollouts.domain.plan import (
    DEFAULT_PLAN,
    Decision,
    PlanError,
    RolloutPlan,
    Stage,
    parse_plan,
)
from rollouts.models import Rollout
from rollouts.services import Override, admit

__all__ = [
    "Controls",
    "abort_waiting",
    "apply_traffic",
    "begin_step",
    "control",
    "end_rollout",
    "ensure_candidate_pools",
    "evaluations",
    "model_plan",
    "plan_of",
    "retire_expired",
    "set_model_plan",
    "start_plan",
]


class Controls(enum.StrEnum):
    """What an admin may do to a running rollout."""

    PAUSE = "pause"
    RESUME = "resume"
    APPROVE = "approve"
    ABORT = "abort"


def _plan_or_400(data: Mapping[str, Any], *, prefix: str = "plan.") -> RolloutPlan:
    try:
        plan = parse_plan(data)
    except PlanError as exc:
        param, message = exc.problems[0]
        raise InvalidRequest(
            f"{prefix}{param} {message}", param=f"{prefix}{param}"
        ) from None
    judge = plan.judge
    if (
        judge is not None
        and not Model.objects.filter(pk=judge.model, kind=ModelKind.CHAT).exists()
    ):
        raise InvalidRequest(
            f"{prefix}judge.model {judge.model!r} is not a chat model of the platform",
            param=f"{prefix}judge.model",
        )
    return plan


def model_plan(model: Model) -> RolloutPlan:
    """Return the model's rollout plan (its stored one, else the default)."""
    if not model.rollout_plan:
        return DEFAULT_PLAN
    try:
        return parse_plan(model.rollout_plan)
    except PlanError:
        # Stored through set_model_plan, so valid when written; a plan the code
        # no longer accepts falls back to the default rather than stopping every
        # rollout of the model.
        return DEFAULT_PLAN


def set_model_plan(model_id: str, data: Mapping[str, Any]) -> RolloutPlan:
    """Validate and store the model's rollout plan; an empty body resets it."""
    plan = _plan_or_400(data, prefix="") if data else DEFAULT_PLAN
    with transaction.atomic():
        model = get_model(model_id, for_update=True)
        model.rollout_plan = plan.to_json() if data else {}
        model.save(update_fields=["rollout_plan", "updated_at"])
    return plan


def plan_of(rollout: Rollout) -> RolloutPlan | None:
    """Return the plan a rollout follows; None for a stage set by hand.

    A stored plan the code no longer accepts is followed as the default plan
    rather than stopping the guards.
    """
    if rollout.plan is None:
        return None
    try:
        return parse_plan(rollout.plan)
    except PlanError:
        return DEFAULT_PLAN


def start_plan(
    *,
    model_id: str,
    version: str,
    now: datetime,
    plan: Mapping[str, Any] | None = None,
    override: Override | None = None,
) -> Rollout:
    """Start ``version`` on a plan (``plan``, else the model's): its first step.

    The candidate gets a pool in every region where the live version has one,
    sized for the step's share of the live pool (the autoscaler sizes it from
    there). Its traffic begins once it serves (``begin_step``). A pending rollout
    is superseded. Refused like ``set_rollout``: 409 for the live version or one
    that is not ready (unless ``override``), 400 for an invalid plan.
    """
    with transaction.atomic():
        model = get_model(model_id, for_update=True)
        chosen = _plan_or_400(plan) if plan else model_plan(model)
        candidate = get_version(model_id, version)
        if candidate.pk == model.live_version_id:
            raise Conflict(
                f"{candidate.ref} is already live; a rollout needs another version",
                param="version",
                code="version_is_live",
            )
        first = chosen.steps[0]
        admit(
            candidate,
            action="rollout",
            override=override,
            now=now,
            stage=first.stage.value,
            percent=first.percent,
        )
        Rollout.objects.filter(model=model, decision=Decision.PENDING).update(
            decision=Decision.SUPERSEDED, decided_at=now
        )
        rollout = Rollout.objects.create(
            model=model,
            version=candidate,
            stage=first.stage.value,
            percent=first.percent,
            started_at=now,
            plan=chosen.to_json(),
            step=0,
            step_started_at=None,
            previous_version_id=model.live_version_id,
            reason="waiting for the candidate's replicas to serve",
        )
        model.canary_version = None
        model.canary_percent = 0.0
        model.save(update_fields=["canary_version", "canary_percent", "updated_at"])
        ensure_candidate_pools(model, candidate, percent=first.percent)
    return rollout


def ensure_candidate_pools(
    model: Model, candidate: ModelVersion, *, percent: float
) -> None:
    """Give the candidate a pool beside each of the live version's, sized for
    ``percent`` of it: extra capacity, the live pool is never drained for it.

    An existing pool (one the gates kept, or an admin's) keeps its settings; only
    its bounds grow to reach the share.
    """
    if model.live_version_id is None:
        return
    for live in Pool.objects.filter(version_id=model.live_version_id, staging=False):
        share = max(1, math.ceil(live.target_replicas * percent / 100.0))
        pool = Pool.objects.filter(version=candidate, region=live.region).first()
        if pool is None:
            Pool.objects.create(
                model=model,
                version=candidate,
                region=live.region,
                min_replicas=1,
                max_replicas=max(1, live.max_replicas),
                desired_replicas=min(share, max(1, live.max_replicas)),
                warm_floor=0,
                target_utilisation=live.target_utilisation,
                scale_down_utilisation=live.scale_down_utilisation,
                stable_window_s=live.stable_window_s,
                panic_window_s=live.panic_window_s,
                panic_factor=live.panic_factor,
                scale_down_interval_s=live.scale_down_interval_s,
            )
            continue
        changed = []
        if pool.min_replicas < 1:
            # However quiet it is, a candidate taking traffic keeps a replica.
            pool.min_replicas = 1
            changed.append("min_replicas")
        if pool.staging:
            pool.staging = False
            changed.append("staging")
        if pool.max_replicas < live.max_replicas:
            pool.max_replicas = live.max_replicas
            changed.append("max_replicas")
        if (pool.desired_replicas or pool.min_replicas) < share:
            pool.desired_replicas = min(share, pool.max_replicas)
            changed.append("desired_replicas")
        if changed:
            pool.save(update_fields=changed)


def apply_traffic(model: Model, rollout: Rollout) -> None:
    """Point the model's canary fields at the rollout's step (shadow: none)."""
    if rollout.stage == Stage.CANARY:
        model.canary_version_id = rollout.version_id
        model.canary_percent = rollout.percent
    else:
        model.canary_version = None
        model.canary_percent = 0.0
    model.save(update_fields=["canary_version", "canary_percent", "updated_at"])


def begin_step(rollout_id: int, *, now: datetime, percent: float | None = None) -> bool:
    """Start the traffic of a rollout's step that waits for its replicas; True if
    it began. Call once the candidate serves in every region of its pools.

    ``percent``: a larger share for a quiet pool (``plan.step_share``); its pools
    grow to it, and the step begins at it meanwhile.
    """
    model_id = (
        Rollout.objects.filter(pk=rollout_id).values_list("model_id", flat=True).first()
    )
    if model_id is None:
        return False
    with transaction.atomic():
        # The model first, then the rollout: the order every writer takes.
        model = get_model(model_id, for_update=True)
        rollout = (
            Rollout.objects.select_for_update(no_key=True)
            .filter(pk=rollout_id, decision=Decision.PENDING, step_started_at=None)
            .first()
        )
        if rollout is None:
            return False
        rollout.step_started_at = now
        rollout.reason = "the candidate serves: its traffic began"
        fields = ["step_started_at", "reason"]
        if percent is not None and percent > rollout.percent:
            rollout.percent = percent
            rollout.reason += f" at {percent:.3g}%, raised for a quiet pool"
            fields.append("percent")
            ensure_candidate_pools(model, rollout.version, percent=percent)
        rollout.save(update_fields=fields)
        apply_traffic(model, rollout)
    return True


def end_rollout(
    rollout: Rollout, decision: Decision, *, now: datetime, reject: str | None
) -> None:
    """End a locked pending rollout with no promotion: the canary share goes to
    zero (the alias never left the live version). With ``reject``, the candidate
    is rejected for that reason (its pools are then released)."""
    model = get_model(rollout.model_id, for_update=True)
    if model.canary_version_id == rollout.version_id:
        model.canary_version = None
        model.canary_percent = 0.0
        model.save(update_fields=["canary_version", "canary_percent", "updated_at"])
    rollout.decision = decision
    rollout.decided_at = now
    rollout.save(update_fields=["decision", "decided_at", "guard_metrics", "reason"])
    if reject is not None:
        where = f"{rollout.stage} {rollout.percent:g}%"
        ModelVersion.objects.filter(pk=rollout.version_id).exclude(
            status=VersionStatus.LIVE
        ).update(
            status=VersionStatus.REJECTED,
            status_reason=f"rolled back at {where}: {reject}"[:2000],
        )


def control(model_id: str, action: str, *, by: str, now: datetime) -> Rollout:
    """Pause, resume, approve or abort the model's pending rollout.

    Pause holds a plan at its step (the guards still roll back on a trip);
    approve lets a step that waits for approval advance; abort ends the rollout
    with the traffic back on the live version and nothing rejected.

    Raises:
        InvalidRequest: an unknown action.
        NotFound: the model has no pending rollout.
        Conflict: pause, resume or approve of a stage set by hand (no plan).
    """
    try:
        chosen = Controls(action)
    except ValueError:
        raise InvalidRequest(
            f"action must be one of {[c.value for c in Controls]}", param="action"
        ) from None
    with transaction.atomic():
        get_model(model_id, for_update=True)
        rollout = (
            Rollout.objects.select_for_update(no_key=True)
            .filter(model_id=model_id, decision=Decision.PENDING)
            .first()
        )
        if rollout is None:
            raise NotFound(f"{model_id} has no rollout running", param="model")
        if chosen == Controls.ABORT:
            rollout.reason = f"aborted by {by}"[:2000]
            end_rollout(rollout, Decision.ABORTED, now=now, reject=None)
            return rollout
        if rollout.plan is None:
            raise Conflict(
                f"the rollout of {rollout.version} was set by hand: it has no plan "
                f"to {chosen.value}; set its stage with PUT, or abort it",
                param="action",
                code="rollout_has_no_plan",
            )
        if chosen == Controls.PAUSE:
            rollout.paused = True
            rollout.reason = f"paused by {by}"[:2000]
        elif chosen == Controls.RESUME:
            rollout.paused = False
            rollout.reason = f"resumed by {by}"[:2000]
        else:
            rollout.approved_step = rollout.step
            rollout.reason = f"step {rollout.step} approved by {by}"[:2000]
        rollout.save(update_fields=["paused", "approved_step", "reason"])
    return rollout


def abort_waiting(rollout_id: int, *, reason: str, now: datetime) -> bool:
    """Abort a rollout whose step still waits for its replicas; True if it did.

    By its id, under the locks: a rollout that began meanwhile, or that an admin
    replaced, is left alone.
    """
    model_id = (
        Rollout.objects.filter(pk=rollout_id).values_list("model_id", flat=True).first()
    )
    if model_id is None:
        return False
    with transaction.atomic():
        get_model(model_id, for_update=True)
        rollout = (
            Rollout.objects.select_for_update(no_key=True)
            .filter(pk=rollout_id, decision=Decision.PENDING, step_started_at=None)
            .first()
        )
        if rollout is None:
            return False
        rollout.reason = reason[:2000]
        end_rollout(rollout, Decision.ABORTED, now=now, reject=None)
    return True


def retire_expired(*, now: datetime) -> list[str]:
    """Retire the versions whose retention after a promotion has ended.

    A version is retired only if nothing sends it traffic any more: not live, not
    the candidate of a pending rollout. Returns the retired versions' refs; their
    pools are released by the node agents' sweep.
    """
    retired: list[str] = []
    due = Rollout.objects.filter(
        decision=Decision.PROMOTED,
        retire_after__lte=now,
        retired_at=None,
        previous_version__isnull=False,
    ).select_related("previous_version", "version")
    for rollout in due:
        with transaction.atomic():
            model = get_model(rollout.model_id, for_update=True)
            old = rollout.previous_version
            assert old is not None
            busy = (
                old.pk == model.live_version_id
                or Rollout.objects.filter(
                    version=old, decision=Decision.PENDING
                ).exists()
                # A later promotion replaced it too (the alias went back to it
                # meanwhile): that promotion's retention keeps it.
                or Rollout.objects.filter(
                    decision=Decision.PROMOTED,
                    previous_version=old,
                    retired_at=None,
                    retire_after__gt=now,
                )
                .exclude(pk=rollout.pk)
                .exists()
            )
            if not busy:
                ModelVersion.objects.filter(pk=old.pk).exclude(
                    status=VersionStatus.LIVE
                ).update(
                    status=VersionStatus.RETIRED,
                    status_reason=f"retired {now.isoformat()} after the retention "
                    f"of {rollout.version.ref}'s promotion",
                )
                retired.append(old.ref)
            Rollout.objects.filter(pk=rollout.pk).update(retired_at=now)
    return retired


def evaluations(rollout: Rollout, *, limit: int = 50) -> list[dict[str, Any]]:
    """Return a rollout's latest guard evaluations as the API shows them."""
    return [
        {
            "at": e.at.isoformat(),
            "step": e.step,
            "stage": e.stage,
            "percent": e.percent,
            "action": e.action,
            "reason": e.reason,
            "report": e.report,
        }
        for e in rollout.evaluations.all()[:limit]
    ]
