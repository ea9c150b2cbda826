"""One rollout's guard tick, written once for the live task and the rollout drill.

Each guard period, for a pending rollout whose step has begun:

1. read the candidate's figures in its role (``shadow`` in a shadow step, else
   ``canary``) and the live version's in ``guards.baseline_roles``, both since
   the step began (the driver's store counts the bucket holding it whole);
2. compare them (``guards.compare``, with the plan's thresholds and its
   live-answer judge's floor; the default plan's for a stage set by hand) and decide (``plan.decide_step``, or
   ``plan.decide_manual`` without a plan);
3. lock the rollout as it was decided on: if an admin or another tick moved it
   meanwhile, stop here (the next tick decides again);
4. a promotion the version gates would refuse holds instead (the alias then
   moves only with an admin's override);
5. record the evaluation, then act: stay in the step (at a raised share when
   the pool is too quiet for a decision in time), advance to the next step's
   share, promote, or roll back.

``guard_tick`` does no I/O and reads no clock. It is a generator that yields
*effects* and is resumed with the answer: ``ReadFigures`` (answered with
``VersionFigures``), ``LockRollout`` (True if it still stands as decided on),
``ReadGates`` (the gates' refusal, or None) and the writes ``RecordEvaluation``,
``StayInStep``, ``RaiseShare``, ``AdvanceStep``, ``Promote`` and ``RollBack``
(answered with None). It returns the ``Evaluation``, or None when the lock failed. The live
task (``control.rollout_guard``) performs the effects on the database, in one
transaction from the lock on; the rollout drill (``drills.domain.rollout_drill``)
on its own state in virtual time. So the drill measures this code, not a copy.
Times are seconds on the driver's clock (unix seconds live).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, replace

from metering.domain.figures import Role, VersionFigures
from rollouts.domain.guards import GuardReport, JudgeCheck, baseline_roles, compare
from rollouts.domain.plan import (
    DEFAULT_PLAN,
    GuardAction,
    PlanState,
    RolloutPlan,
    Stage,
    StepDecision,
    StepSpec,
    decide_manual,
    decide_step,
    step_share,
)

__all__ = [
    "AdvanceStep",
    "Effect",
    "Evaluation",
    "GuardedRollout",
    "LockRollout",
    "Promote",
    "RaiseShare",
    "ReadFigures",
    "ReadGates",
    "RecordEvaluation",
    "Reply",
    "RollBack",
    "StayInStep",
    "Steps",
    "drive",
    "guard_tick",
]


@dataclass(frozen=True, slots=True)
class GuardedRollout:
    """A pending rollout as a tick reads it, its step begun at ``step_started_at``.

    ``live``: the live version's label (None: the model has none, so nothing to
    compare with). ``plan`` None: a stage set by hand, guarded but never moved.
    ``paused`` and ``approved_step`` are an admin's controls.
    """

    model: str
    candidate: str
    live: str | None
    stage: Stage
    percent: float
    step: int
    step_started_at: float
    plan: RolloutPlan | None
    paused: bool = False
    approved_step: int | None = None
    # The pool's requests per second (all versions), from which a quiet pool's
    # step gets a larger share; None: unknown, the share stays the step's.
    pool_rps: float | None = None
    guard_period_s: float = 60.0
    # The plan's live-answer judge, as people's labels rate it: False when its
    # agreement is below the floor (its guard is then shown ``off``), and one
    # sentence on that agreement for the guard's reason.
    judge_trusted: bool = True
    judge_agreement: str = ""

    @property
    def role(self) -> Role:
        """The figures' role of the candidate in this step."""
        return Role.SHADOW if self.stage is Stage.SHADOW else Role.CANARY


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One tick's evaluation of the step it judged: the decision and its grounds."""

    rollout: GuardedRollout
    at: float
    decision: StepDecision
    report: GuardReport
    candidate: VersionFigures
    live: VersionFigures

    def report_json(self) -> dict[str, object]:
        """The report as the evaluation stores it, with the decision's expected
        time to a decision and the share it raised the step to (the console's)."""
        return {
            **self.report.to_json(),
            "expected_decision_s": self.decision.expected_decision_s,
            "raised_to_percent": self.decision.percent,
        }


# -- effects --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadFigures:
    """Return ``version``'s figures in ``role`` since ``since`` (its bucket whole)."""

    model: str
    version: str
    role: Role
    since: float


@dataclass(frozen=True, slots=True)
class LockRollout:
    """Lock ``rollout``; answer True if it still stands as read (same step, same
    start, same pause and approval, still pending), else False."""

    rollout: GuardedRollout


@dataclass(frozen=True, slots=True)
class ReadGates:
    """Return why the version gates refuse ``version`` traffic; None if they don't."""

    model: str
    version: str


@dataclass(frozen=True, slots=True)
class RecordEvaluation:
    """Store the evaluation (the console's and the API's history)."""

    evaluation: Evaluation


@dataclass(frozen=True, slots=True)
class StayInStep:
    """Keep the step (continue or hold); store the report and the reason."""

    reason: str
    report: GuardReport


@dataclass(frozen=True, slots=True)
class AdvanceStep:
    """Move to step ``step`` (``spec``) from now: its share, by the same split."""

    step: int
    spec: StepSpec
    reason: str
    report: GuardReport


@dataclass(frozen=True, slots=True)
class RaiseShare:
    """Stay in the step at a larger share, ``percent`` (within the plan's limits),
    so that its guards can decide in time; the step's clock keeps running."""

    percent: float
    reason: str
    report: GuardReport


@dataclass(frozen=True, slots=True)
class Promote:
    """Point the alias at the candidate; retain the old version ``retention_s``."""

    retention_s: float
    reason: str
    report: GuardReport


@dataclass(frozen=True, slots=True)
class RollBack:
    """Send the candidate's share back to live and reject the candidate."""

    reason: str
    report: GuardReport


Effect = (
    ReadFigures
    | LockRollout
    | ReadGates
    | RecordEvaluation
    | StayInStep
    | AdvanceStep
    | RaiseShare
    | Promote
    | RollBack
)
# What a driver sends back: figures, the lock's answer, a refusal, or None.
Reply = VersionFigures | bool | str | None
Steps = Generator[Effect, Reply, Evaluation | None]


# -- the tick -------------------------------------------------------------------------


def guard_tick(rollout: GuardedRollout, *, now: float) -> Steps:
    """Run one guard tick of ``rollout`` at ``now`` (see the module docstring)."""
    since = rollout.step_started_at
    candidate = yield ReadFigures(rollout.model, rollout.candidate, rollout.role, since)
    assert isinstance(candidate, VersionFigures)
    live = VersionFigures()
    if rollout.live is not None:
        for role in baseline_roles(rollout.role):
            part = yield ReadFigures(rollout.model, rollout.live, role, since)
            assert isinstance(part, VersionFigures)
            live += part
    plan = rollout.plan
    judge = (
        JudgeCheck(
            plan.judge.min_win_rate,
            trusted=rollout.judge_trusted,
            agreement=rollout.judge_agreement,
        )
        if plan is not None and plan.judge is not None
        else None
    )
    report = compare(candidate, live, (plan or DEFAULT_PLAN).thresholds, judge)
    decision = _decide(rollout, report, candidate, now=now)
    if not (yield LockRollout(rollout)):
        return None  # an admin or another tick moved it meanwhile
    if decision.promote:
        refusal = yield ReadGates(rollout.model, rollout.candidate)
        if refusal is not None:
            assert isinstance(refusal, str)
            decision = StepDecision(
                GuardAction.HOLD,
                f"the guards pass, but {refusal}: the alias moves only with an "
                "admin's override (PUT .../alias)",
            )
    evaluation = Evaluation(rollout, now, decision, report, candidate, live)
    yield RecordEvaluation(evaluation)
    yield _act(rollout, decision, report)
    return evaluation


def _decide(
    rollout: GuardedRollout,
    report: GuardReport,
    candidate: VersionFigures,
    *,
    now: float,
) -> StepDecision:
    if rollout.plan is None:
        return decide_manual(report)
    return decide_step(
        rollout.plan,
        PlanState(
            step=rollout.step,
            step_started_at=rollout.step_started_at,
            paused=rollout.paused,
            approved_step=rollout.approved_step,
        ),
        report,
        now=now,
        requests=candidate.requests,
        conversations=candidate.conversations,
        percent=rollout.percent,
        pool_rps=rollout.pool_rps,
        guard_period_s=rollout.guard_period_s,
    )


def _act(
    rollout: GuardedRollout, decision: StepDecision, report: GuardReport
) -> Effect:
    """The one write that carries out ``decision`` (a next step at its share for
    the pool's traffic, ``plan.step_share``)."""
    plan = rollout.plan
    reason = decision.reason
    if decision.action is GuardAction.ROLL_BACK:
        return RollBack(reason, report)
    if decision.action is GuardAction.ADVANCE and plan is not None:
        if decision.next_step is None:
            return Promote(plan.retention_s, reason, report)
        spec = plan.steps[decision.next_step]
        share = step_share(
            plan, decision.next_step, rollout.pool_rps, rollout.guard_period_s
        )
        return AdvanceStep(
            decision.next_step, replace(spec, percent=share), reason, report
        )
    if decision.percent is not None and plan is not None:
        return RaiseShare(decision.percent, reason, report)
    return StayInStep(reason, report)


def drive(steps: Steps, perform: Callable[[Effect], Reply]) -> Evaluation | None:
    """Run a tick to its end, ``perform`` answering each effect; return its result.

    An exception ``perform`` raises ends the tick there (the live driver's
    transaction then rolls back whatever the tick wrote).
    """
    reply: Reply = None
    while True:
        try:
            effect = steps.send(reply)
        except StopIteration as done:
            result: Evaluation | None = done.value
            return result
        reply = perform(effect)
