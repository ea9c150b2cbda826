"""The rollout guards' live loop: begin steps, evaluate, retire, release pools.

The rollouts app holds the plans (``rollouts.plans``) and the pure tick
(``rollouts.domain.guard_tick``); this module, beside the node agents whose
replicas it counts, runs one tick of every pending rollout (Celery beat,
``control.guard_rollouts``):

1. versions past their retention after a promotion are retired;
2. the figures the gateways recorded are flushed, so the guards read the last
   bucket too;
3. a step that waits for its candidate's replicas begins once they serve (or the
   rollout is aborted past ``PLATFORM_ROLLOUT_CAPACITY_TIMEOUT_S``);
4. every begun step is evaluated and acted on (continue, advance, hold, roll
   back): ``tick_rollout`` performs the pure tick's effects on the database;
5. pools nothing sends traffic to any more (retired versions, rolled-back
   candidates) are released: their replicas drain (streams finish, then they
   stop) and the pool row goes. An aborted candidate keeps its pools.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Q

from engine_nodes.domain.liveness import ReplicaState, is_silent
from engine_nodes.models import Replica
from metering import services as metering
from metering.domain.figures import Role, VersionFigures
from models_registry.domain.gates import (
    GateConfig,
    parse_gate_config,
    traffic_refusal,
)
from models_registry.domain.identity import VersionStatus
from models_registry.judge_labels import agreement_for, judge_version
from models_registry.models import Model, ModelVersion, Pool
from models_registry.services import get_model, status_after_live
from rollouts import plans
from rollouts.domain.guard_tick import (
    AdvanceStep,
    Effect,
    Evaluation,
    GuardedRollout,
    LockRollout,
    Promote,
    RaiseShare,
    ReadFigures,
    ReadGates,
    RecordEvaluation,
    Reply,
    RollBack,
    StayInStep,
    drive,
    guard_tick,
)
from rollouts.domain.plan import Decision, RolloutPlan, Stage, StepSpec, step_share
from rollouts.models import GuardEvaluation, Rollout

logger = logging.getLogger(__name__)

__all__ = [
    "FiguresReader",
    "GuardTick",
    "candidate_serves",
    "guard_rollouts",
    "release_pools",
    "tick_rollout",
]

# What reads a version's figures: (model, version label, role, since) -> figures.
FiguresReader = Callable[[str, str, str, datetime], VersionFigures]


@dataclass(slots=True)
class GuardTick:
    """What one tick did, for the task's log and the tests."""

    retired: list[str] = field(default_factory=list)
    begun: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)
    actions: dict[int, str] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)


def _figures(model: str, version: str, role: str, since: datetime) -> VersionFigures:
    return metering.version_figures(
        model_id=model, version=version, role=role, since=since
    )


def candidate_serves(version: ModelVersion, *, now: datetime) -> bool:
    """Return True when ``version`` has a serving, beating replica in every region
    where it has a pool (and has at least one pool)."""
    regions = set(Pool.objects.filter(version=version).values_list("region", flat=True))
    if not regions:
        return False
    beat_s = settings.PLATFORM_HEARTBEAT_DB_S
    missed = settings.PLATFORM_MISSED_BEATS
    serving = {
        r.region
        for r in Replica.objects.filter(
            version=version, state=ReplicaState.SERVING, region__in=regions
        )
        if not is_silent(r.last_heartbeat, now, beat_s, missed)
    }
    return serving >= regions


def guard_rollouts(
    *,
    now: datetime,
    flush: bool = True,
    figures: FiguresReader | None = None,
) -> GuardTick:
    """Run one tick of every rollout's guards (see the module docstring).

    ``figures`` reads a version's figures (default: ``version_figures`` from the
    database, flushed from Redis first unless ``flush`` is False).
    """
    tick = GuardTick()
    # Each part on its own: one rollout that fails (a lock timeout, a plan the
    # code no longer reads) must not keep every other model's guards, rollbacks
    # included, from running.
    try:
        tick.retired = plans.retire_expired(now=now)
    except Exception:
        logger.exception("retiring versions past their retention failed")
    if flush and settings.REDIS_URL:
        try:
            with redis.Redis.from_url(settings.REDIS_URL, socket_timeout=10) as client:
                metering.flush_redis_figures(
                    client=client,
                    prefix=settings.REDIS_KEY_PREFIX,
                    region=settings.PLATFORM_REGION,
                    now=now,
                )
        except Exception:
            # Guards then read what reached the database; the next tick flushes.
            logger.warning("flushing the figures failed", exc_info=True)
    timeout = timedelta(seconds=settings.PLATFORM_ROLLOUT_CAPACITY_TIMEOUT_S)
    pending = Rollout.objects.filter(decision=Decision.PENDING).select_related(
        "version"
    )
    for rollout in pending:
        try:
            _tick_one(rollout, tick, now=now, timeout=timeout, figures=figures)
        except Exception:
            logger.exception("the guards of rollout %s failed this tick", rollout.pk)
    try:
        tick.released = release_pools(now=now)
    except Exception:
        logger.exception("releasing unused pools failed")
    return tick


def _tick_one(
    rollout: Rollout,
    tick: GuardTick,
    *,
    now: datetime,
    timeout: timedelta,
    figures: FiguresReader | None,
) -> None:
    if rollout.step_started_at is None:
        if candidate_serves(rollout.version, now=now):
            if plans.begin_step(
                rollout.pk, now=now, percent=_begin_share(rollout, now, figures)
            ):
                tick.begun.append(rollout.pk)
        elif now - rollout.started_at > timeout and plans.abort_waiting(
            rollout.pk,
            reason=f"aborted by the guards: {rollout.version.ref} had no serving "
            f"replica in every region of its pools within "
            f"{timeout.total_seconds():g} s",
            now=now,
        ):
            tick.aborted.append(rollout.pk)
        return
    evaluation = tick_rollout(rollout.pk, now=now, figures=figures or _figures)
    if evaluation is not None:
        tick.actions[rollout.pk] = evaluation.action
        logger.info(
            "rollout %s of %s at %s %g%%: %s",
            rollout.pk,
            rollout.version.ref,
            evaluation.stage,
            evaluation.percent,
            evaluation.action,
        )


def tick_rollout(
    rollout_id: int, *, now: datetime, figures: FiguresReader
) -> GuardEvaluation | None:
    """Run one pending rollout's guard tick (``rollouts.domain.guard_tick``) and act.

    Returns the stored evaluation; None when the rollout is no longer pending,
    its step has not begun, or an admin or another tick moved it meanwhile.
    ``figures`` reads a version's figures since a time.
    """
    rollout = (
        Rollout.objects.select_related("version", "model__live_version")
        .filter(pk=rollout_id, decision=Decision.PENDING)
        .first()
    )
    if rollout is None or rollout.step_started_at is None:
        return None
    live = rollout.model.live_version
    versions = [rollout.version.version] + ([] if live is None else [live.version])
    plan = plans.plan_of(rollout)
    judge_trusted, judge_agreement = _judge_trust(rollout.model, plan)
    guarded = GuardedRollout(
        model=rollout.model_id,
        candidate=rollout.version.version,
        live=None if live is None else live.version,
        stage=Stage(rollout.stage),
        percent=rollout.percent,
        step=rollout.step,
        step_started_at=rollout.step_started_at.timestamp(),
        plan=plan,
        paused=rollout.paused,
        approved_step=rollout.approved_step,
        pool_rps=_pool_rps(rollout.model_id, versions, now=now, figures=figures),
        guard_period_s=settings.PLATFORM_ROLLOUT_GUARD_INTERVAL_S,
        judge_trusted=judge_trusted,
        judge_agreement=judge_agreement,
    )
    with ExitStack() as stack:
        driver = _LiveTick(rollout, now=now, figures=figures, stack=stack)
        drive(guard_tick(guarded, now=now.timestamp()), driver.perform)
        return driver.evaluation


def _judge_trust(model: Model, plan: RolloutPlan | None) -> tuple[bool, str]:
    """Whether the plan's live-answer judge may gate, and its agreement with
    people in one sentence (the model's gate floor, as the eval gate holds it)."""
    if plan is None or plan.judge is None:
        return True, ""
    judge = judge_version(plan.judge.model)
    if judge is None:
        return True, f"the judge {plan.judge.model} has no live version to ask"
    config, problems = parse_gate_config(model.gate_config)
    if problems:
        config = GateConfig()
    agreement = agreement_for(
        judge, min_kappa=config.min_kappa, min_labels=config.min_labels
    )
    return agreement.can_gate, agreement.reason


def _begin_share(
    rollout: Rollout, now: datetime, figures: FiguresReader | None
) -> float | None:
    """The share a planned step begins at for the pool's traffic; None: its own."""
    plan = plans.plan_of(rollout)
    if plan is None or not 0 <= rollout.step < len(plan.steps):
        return None
    live = rollout.model.live_version
    versions = [rollout.version.version] + ([] if live is None else [live.version])
    pool_rps = _pool_rps(
        rollout.model_id, versions, now=now, figures=figures or _figures
    )
    return step_share(
        plan, rollout.step, pool_rps, settings.PLATFORM_ROLLOUT_GUARD_INTERVAL_S
    )


# The window the pool's request rate is read over (a step's share follows it).
POOL_RATE_WINDOW_S = 600.0


def _pool_rps(
    model: str, versions: list[str], *, now: datetime, figures: FiguresReader
) -> float | None:
    """Return the model's requests per second over the last ``POOL_RATE_WINDOW_S``
    (every role of the live version and the candidate; None with none seen).

    The reader counts the bucket holding the window's start whole, so this reads
    up to a bucket high: a share planned on it errs a little small.
    """
    since = now - timedelta(seconds=POOL_RATE_WINDOW_S)
    requests = sum(
        figures(model, version, role.value, since).requests
        for version in versions
        for role in (Role.LIVE, Role.BASELINE, Role.CANARY)
    )
    return requests / POOL_RATE_WINDOW_S if requests else None


_Write = RecordEvaluation | StayInStep | RaiseShare | AdvanceStep | Promote | RollBack


class _LiveTick:
    """Perform one tick's effects on the database: reads before the lock, every
    write in the transaction the lock opens (``stack`` closes it)."""

    def __init__(
        self,
        rollout: Rollout,
        *,
        now: datetime,
        figures: FiguresReader,
        stack: ExitStack,
    ) -> None:
        self.rollout = rollout  # as read before the lock
        self.now = now
        self.figures = figures
        self.stack = stack
        self.locked: Rollout | None = None
        self.evaluation: GuardEvaluation | None = None
        self.expected_decision_s: float | None = None

    def perform(self, effect: Effect) -> Reply:
        if isinstance(effect, ReadFigures):
            since = datetime.fromtimestamp(effect.since, tz=UTC)
            return self.figures(effect.model, effect.version, effect.role, since)
        if isinstance(effect, LockRollout):
            return self._lock(effect.rollout)
        if isinstance(effect, ReadGates):
            version = ModelVersion.objects.get(
                model_id=effect.model, version=effect.version
            )
            return traffic_refusal(version.ref, version.status, version.status_reason)
        self._write(effect)
        return None

    def _lock(self, guarded: GuardedRollout) -> bool:
        self.stack.enter_context(transaction.atomic())
        # The model first, then the rollout: the order every writer takes (an
        # admin's control, PUT rollout or alias), so none of them deadlocks a tick.
        get_model(guarded.model, for_update=True)
        self.locked = (
            Rollout.objects.select_for_update(no_key=True)
            .filter(
                pk=self.rollout.pk,
                decision=Decision.PENDING,
                step=guarded.step,
                step_started_at=self.rollout.step_started_at,
                # Decided on these: a pause or an approval meanwhile waits a tick.
                paused=guarded.paused,
                approved_step=guarded.approved_step,
            )
            .first()
        )
        return self.locked is not None

    def _write(self, effect: _Write) -> None:
        locked = self.locked
        assert locked is not None, "a tick writes only under its lock"
        now = self.now
        if isinstance(effect, RecordEvaluation):
            self.evaluation = _record(locked, effect.evaluation, now=now)
            self.expected_decision_s = effect.evaluation.decision.expected_decision_s
            return
        locked.guard_metrics = {
            "at": now.isoformat(),
            **effect.report.to_json(),
            # The console's "decision expected in": the tick's own estimate.
            "expected_decision_s": self.expected_decision_s,
        }
        locked.reason = effect.reason[:2000]
        if isinstance(effect, RollBack):
            plans.end_rollout(
                locked, Decision.ROLLED_BACK, now=now, reject=effect.reason
            )
        elif isinstance(effect, Promote):
            _promote(locked, retention_s=effect.retention_s, now=now)
        elif isinstance(effect, AdvanceStep):
            _advance(locked, effect.step, effect.spec, now=now)
        elif isinstance(effect, RaiseShare):
            _raise_share(locked, effect.percent)
        else:
            locked.save(update_fields=["guard_metrics", "reason"])


def _record(
    rollout: Rollout, evaluation: Evaluation, *, now: datetime
) -> GuardEvaluation:
    decision = evaluation.decision
    return GuardEvaluation.objects.create(
        rollout=rollout,
        at=now,
        step=rollout.step,
        stage=rollout.stage,
        percent=rollout.percent,
        action=decision.action.value,
        reason=decision.reason[:2000],
        report=evaluation.report_json(),
        candidate=evaluation.candidate.to_json(),
        live=evaluation.live.to_json(),
    )


def _advance(rollout: Rollout, step: int, spec: StepSpec, *, now: datetime) -> None:
    """Move a locked rollout to ``step`` from now: its share and its pools."""
    model = get_model(rollout.model_id, for_update=True)
    rollout.step = step
    rollout.stage = spec.stage.value
    rollout.percent = spec.percent
    rollout.step_started_at = now
    rollout.approved_step = None
    rollout.save(
        update_fields=[
            "guard_metrics",
            "reason",
            "step",
            "stage",
            "percent",
            "step_started_at",
            "approved_step",
        ]
    )
    plans.ensure_candidate_pools(model, rollout.version, percent=spec.percent)
    plans.apply_traffic(model, rollout)


def _raise_share(rollout: Rollout, percent: float) -> None:
    """Keep a locked rollout's step at a larger share: its pools and traffic."""
    model = get_model(rollout.model_id, for_update=True)
    rollout.percent = percent
    rollout.save(update_fields=["guard_metrics", "reason", "percent"])
    plans.ensure_candidate_pools(model, rollout.version, percent=percent)
    plans.apply_traffic(model, rollout)


def _promote(rollout: Rollout, *, retention_s: float, now: datetime) -> None:
    """Point the alias at the candidate; keep the old version loaded until its
    retention ends."""
    model = get_model(rollout.model_id, for_update=True)
    previous = model.live_version
    if previous is not None and previous.pk != rollout.version_id:
        ModelVersion.objects.filter(pk=previous.pk).update(
            status=status_after_live(previous)
        )
    ModelVersion.objects.filter(pk=rollout.version_id).update(
        status=VersionStatus.LIVE, status_reason=""
    )
    model.live_version_id = rollout.version_id
    model.canary_version = None
    model.canary_percent = 0.0
    model.save(
        update_fields=["live_version", "canary_version", "canary_percent", "updated_at"]
    )
    rollout.decision = Decision.PROMOTED
    rollout.decided_at = now
    rollout.retire_after = now + timedelta(seconds=retention_s)
    rollout.save(
        update_fields=[
            "decision",
            "decided_at",
            "retire_after",
            "guard_metrics",
            "reason",
        ]
    )


def _released_versions(now: datetime) -> list[ModelVersion]:
    """Versions with pools that nothing sends traffic to any more.

    Only once every gateway has had time to notice (a few snapshot refreshes
    after the rollback, abort or retirement): until then one may still send a
    conversation's next turn there, and a drained pool would answer it 503.
    """
    settled = now - timedelta(seconds=4 * settings.PLATFORM_SNAPSHOT_REFRESH_S)
    in_use: set[int] = set()
    for live, canary in Model.objects.values_list(
        "live_version_id", "canary_version_id"
    ):
        in_use.update(v for v in (live, canary) if v is not None)
    in_use.update(
        Rollout.objects.filter(decision=Decision.PENDING).values_list(
            "version_id", flat=True
        )
    )
    # Kept loaded through their retention after a promotion (a rollback target,
    # and where their conversations finish), and a little past it.
    in_use.update(
        v
        for v in Rollout.objects.filter(decision=Decision.PROMOTED)
        .filter(Q(retired_at=None) | Q(retired_at__gt=settled))
        .values_list("previous_version_id", flat=True)
        if v is not None
    )
    candidates = (
        ModelVersion.objects.filter(pools__staging=False)
        .exclude(pk__in=in_use)
        .distinct()
    )
    released = []
    for version in candidates:
        if version.status == VersionStatus.RETIRED:
            released.append(version)
            continue
        # Rolled back by the guards (so rejected): nothing may send it traffic
        # without an override, which would make it a canary or live again. An
        # aborted candidate keeps its pools: it is still ready, and an admin may
        # go on with it (or remove them).
        if version.status != VersionStatus.REJECTED:
            continue
        last = Rollout.objects.filter(version=version).order_by("-started_at").first()
        if (
            last is not None
            and last.decision == Decision.ROLLED_BACK
            and last.decided_at is not None
            and last.decided_at <= settled
        ):
            released.append(version)
    return released


def release_pools(*, now: datetime) -> list[str]:
    """Drain and remove the pools of versions nothing routes to; return their refs.

    Their replicas are marked draining: they leave the ring at once, their open
    streams finish (or end at the drain deadline with an error event), then their
    agents stop them. A pool the gates are using (staging) is never touched.
    """
    refs = []
    for version in _released_versions(now):
        with transaction.atomic():
            Replica.objects.filter(version=version).exclude(
                Q(state=ReplicaState.GONE) | Q(state=ReplicaState.DRAINING)
            ).update(state=ReplicaState.DRAINING)
            Pool.objects.filter(version=version, staging=False).delete()
        refs.append(version.ref)
        logger.info("pools of %s released: nothing routes to it", version.ref)
    return refs
