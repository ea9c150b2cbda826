"""The stages of a rollout, its plan, and the plan's state machine.

Public surface: ``Stage``, ``Decision``, ``CANARY_STEPS``, ``JudgeSpec``, ``GuardThresholds``
(from ``guards``), ``stage_errors``, ``GuardAction``, ``StepSpec``,
``RolloutPlan``, ``DEFAULT_PLAN``, ``STEP_DEFAULTS``, ``PlanError`` (from
``guards``), ``parse_plan``, ``PlanState``, ``StepDecision``, ``decide_step``,
``decide_manual``.

Seed: shadow traffic first, then a canary at 1%, 10% and 50%, then the alias moves.

A plan is a list of steps, shadow steps first, then canary steps at strictly
rising shares. Each step has minimums (time in the step, the candidate's requests
and conversations) before it may advance, and may wait for an admin's approval.
After the last step the alias moves to the candidate (promote); the old version
stays loaded ``retention_s`` before it is retired.

``decide_step`` is the whole machine, called once per guard period with the
latest ``guards.GuardReport``. Its order is the order of what matters:

1. a guard that says worse rolls back, paused or not: a guard always protects
   users;
2. a paused rollout holds;
3. a pool too quiet for the step's share holds at a larger share (within the
   plan's limits, ``exposure_percent``): its guards could not decide in
   ``max_step_s``, or a total failure within ``DETECTION_PERIODS`` periods;
4. a step short of its minimums continues (and says what it waits for);
5. a guard that is undecided (or has too few samples) holds, extending the
   step, with the expected time to a decision;
6. a step that needs approval holds until the admin approves this step;
7. else (every guard not worse) advance to the next step, at the share the
   pool's traffic needs (``step_share``), or promote after the last.

Shadow steps: a copy's answer is discarded, so the gateway may observe less of
it (it may stop reading at the first token, or not run the refusal detector). In
a shadow step a guard that is ``too_few`` because the candidate side has **no**
samples at all (while live has enough) does not hold the plan, provided the
``p95_ttft`` guard reached a verdict: latency is the one figure every shadow copy
yields, so a shadow with no TTFT samples is broken, not unobserved, and holds.
A shadow with *some* samples below the minimum holds like a canary.

A manual rollout (a stage set by hand, no plan) is guarded too:
``decide_manual`` rolls back on a trip and otherwise never moves.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollouts.domain import sequential
from rollouts.domain.guards import (
    GuardReport,
    GuardResult,
    GuardThresholds,
    PlanError,
    Verdict,
    is_finite_number,
    threshold_problems,
)

__all__ = [
    "ASSUMED_ERROR_RATE",
    "CANARY_STEPS",
    "DEFAULT_PLAN",
    "DETECTION_PERIODS",
    "EXPOSURE_MARGIN",
    "STEP_DEFAULTS",
    "Decision",
    "GuardAction",
    "GuardThresholds",
    "JudgeSpec",
    "PlanError",
    "PlanState",
    "RolloutPlan",
    "Stage",
    "StepDecision",
    "StepSpec",
    "decide_manual",
    "decide_step",
    "expected_decision_s",
    "exposure_percent",
    "parse_plan",
    "samples_for_not_worse",
    "samples_for_total_failure",
    "stage_errors",
    "step_share",
]

CANARY_STEPS: tuple[float, ...] = (1.0, 10.0, 50.0)
# A total failure (every answer an error or a refusal) must be shown worse within
# this many guard periods of a step's start; the exposure that takes is planned
# with this margin, for the ramp (a canary gets new conversations only) and chance.
DETECTION_PERIODS = 2
EXPOSURE_MARGIN = 3.0
# The live error rate a step's exposure is planned for before live has shown its
# own (100 requests): a little below the default threshold.
ASSUMED_ERROR_RATE = 0.004


class Stage(enum.StrEnum):
    """What share of traffic a candidate version sees and how."""

    SHADOW = "shadow"  # copies of requests; output discarded, never affects a caller
    CANARY = "canary"  # real answers for a stable hash-slice of conversations


class Decision(enum.StrEnum):
    """How a rollout ended; ``pending`` while it runs."""

    PENDING = "pending"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"
    SUPERSEDED = "superseded"
    ABORTED = "aborted"  # an admin's abort: traffic back to live, nothing promoted


def stage_errors(stage: str, percent: float) -> list[tuple[str, str]]:
    """Return (param, message) for an invalid stage or share; empty when valid."""
    try:
        Stage(stage)
    except ValueError:
        return [("stage", f"must be one of {[s.value for s in Stage]}")]
    if not 0.0 < percent <= 100.0:
        return [("percent", "must be greater than 0 and at most 100")]
    return []


class GuardAction(enum.StrEnum):
    """What one guard evaluation decided (stored with it in ``guard_metrics``)."""

    CONTINUE = "continue"  # all well; the step's minimums are not met yet
    ADVANCE = "advance"  # on to the next step, or promote after the last
    HOLD = "hold"  # stay: paused, too few samples, or waiting for approval
    ROLL_BACK = "roll_back"  # a guard tripped: traffic back to live


@dataclass(frozen=True, slots=True)
class StepSpec:
    """One step of a plan: a stage at a share, and what it needs to advance.

    ``min_requests`` and ``min_conversations`` count the candidate's, in this
    step. ``needs_approval``: advance only once an admin approved this step.
    """

    stage: Stage
    percent: float
    min_duration_s: float
    min_requests: int
    min_conversations: int
    needs_approval: bool = False

    @property
    def label(self) -> str:
        """The step as a console shows it: ``canary 10%``."""
        return f"{self.stage.value} {self.percent:g}%"

    def to_json(self) -> dict[str, object]:
        """Return the step as JSON (``parse_plan`` reads it back)."""
        return {
            "stage": self.stage.value,
            "percent": self.percent,
            "min_duration_s": self.min_duration_s,
            "min_requests": self.min_requests,
            "min_conversations": self.min_conversations,
            "needs_approval": self.needs_approval,
        }


def _default_steps() -> tuple[StepSpec, ...]:
    return (
        StepSpec(Stage.SHADOW, 1.0, 600.0, 200, 50),
        StepSpec(Stage.CANARY, 1.0, 600.0, 200, 50),
        StepSpec(Stage.CANARY, 10.0, 600.0, 1000, 200),
        StepSpec(Stage.CANARY, 50.0, 600.0, 2000, 500),
    )


@dataclass(frozen=True, slots=True)
class JudgeSpec:
    """A plan's live-answer judge: which served model judges, and how much.

    ``model``: a chat model the platform serves (its live version judges).
    ``share``: the fraction of the candidate's requests (shadow copies or canary
    requests) whose pair is judged; ``per_minute``: at most this many pairs per
    minute per gateway process (the judge's own GPU time is bounded);
    ``min_win_rate``: the judge guard's floor (two equal versions score 0.5).
    """

    model: str
    share: float = 1.0
    per_minute: int = 120
    min_win_rate: float = 0.45

    def to_json(self) -> dict[str, object]:
        """Return the judge as JSON (``parse_plan`` reads it back)."""
        return {
            "model": self.model,
            "share": self.share,
            "per_minute": self.per_minute,
            "min_win_rate": self.min_win_rate,
        }


_JUDGE_KEYS = ("model", "share", "per_minute", "min_win_rate")


def _parse_judge(raw: object) -> tuple[JudgeSpec | None, list[tuple[str, str]]]:
    if raw is None:
        return None, []
    if not isinstance(raw, Mapping):
        return None, [("judge", "must be an object or null")]
    problems = [(f"judge.{k}", "unknown key") for k in raw if k not in _JUDGE_KEYS]
    model = raw.get("model")
    if not isinstance(model, str) or not model or len(model) > 128:
        problems.append(("judge.model", "must name a served chat model"))
    values: dict[str, Any] = {}
    share = raw.get("share", 1.0)
    if not is_finite_number(share) or not 0.0 < share <= 1.0:
        problems.append(("judge.share", "must be above 0 and at most 1"))
    else:
        values["share"] = float(share)
    per_minute = raw.get("per_minute", 120)
    if (
        not isinstance(per_minute, int)
        or isinstance(per_minute, bool)
        or not 1 <= per_minute <= 100_000
    ):
        problems.append(("judge.per_minute", "must be a whole number from 1 to 100000"))
    else:
        values["per_minute"] = per_minute
    floor = raw.get("min_win_rate", 0.45)
    if not is_finite_number(floor) or not 0.0 < floor < 0.5:
        problems.append(("judge.min_win_rate", "must be above 0 and below 0.5"))
    else:
        values["min_win_rate"] = float(floor)
    if problems:
        return None, problems
    assert isinstance(model, str)
    return JudgeSpec(model=model, **values), []


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """A model's rollout plan: its steps, the old version's retention, the guards.

    Build one with ``parse_plan`` (which validates); the dataclass itself does not.
    """

    steps: tuple[StepSpec, ...] = field(default_factory=_default_steps)
    retention_s: float = 86400.0
    thresholds: GuardThresholds = field(default_factory=GuardThresholds)
    # The longest a step should take to decide: a quieter pool gets a larger
    # share (up to the next step's) so that a decision is expected within it.
    max_step_s: float = 3600.0
    # The live-answer judge (issue 38); None: no judge guard.
    judge: JudgeSpec | None = None

    def to_json(self) -> dict[str, object]:
        """Return the plan as JSON (``parse_plan`` reads it back equal)."""
        return {
            "steps": [step.to_json() for step in self.steps],
            "retention_s": self.retention_s,
            "thresholds": self.thresholds.to_json(),
            "max_step_s": self.max_step_s,
            "judge": self.judge.to_json() if self.judge is not None else None,
        }


DEFAULT_PLAN = RolloutPlan(steps=_default_steps(), retention_s=86400.0)

# A step's minimums when a plan leaves them out: the default plan's first step's.
STEP_DEFAULTS: Mapping[str, float | int] = {
    "min_duration_s": 600.0,
    "min_requests": 200,
    "min_conversations": 50,
}

# A year: the longest retention or step a plan may ask for (past it a date
# overflows, and no rollout waits that long).
MAX_SECONDS = 365 * 86400.0

_PLAN_KEYS = ("steps", "retention_s", "thresholds", "max_step_s", "judge")
_STEP_KEYS = (
    "stage",
    "percent",
    "min_duration_s",
    "min_requests",
    "min_conversations",
    "needs_approval",
)


def parse_plan(data: Mapping[str, Any]) -> RolloutPlan:
    """Return the plan in ``data`` (JSON), validated.

    Missing keys take the defaults: no ``steps``, the default steps; a step
    without minimums, ``STEP_DEFAULTS``; no ``thresholds`` (or some of them), the
    default thresholds. ``stage`` and ``percent`` are required in each step.

    Raises:
        PlanError: every problem found, as (param, message), e.g.
            ``("steps[2].percent", "must be above the previous canary step's 10%")``.
    """
    if not isinstance(data, Mapping):
        raise PlanError([("plan", "must be an object")])
    problems: list[tuple[str, str]] = [
        (str(key), "unknown key") for key in data if key not in _PLAN_KEYS
    ]
    steps = _default_steps()
    if "steps" in data:
        parsed, step_problems = _parse_steps(data["steps"])
        problems.extend(step_problems)
        steps = parsed if parsed is not None else steps
    retention_s = 86400.0
    if "retention_s" in data:
        value = data["retention_s"]
        if not is_finite_number(value):
            problems.append(("retention_s", "must be a finite number"))
        elif value < 0:
            problems.append(("retention_s", "must not be negative"))
        elif value > MAX_SECONDS:
            problems.append(("retention_s", f"must be at most {MAX_SECONDS:g} s"))
        else:
            retention_s = float(value)
    max_step_s = 3600.0
    if "max_step_s" in data:
        value = data["max_step_s"]
        if not is_finite_number(value):
            problems.append(("max_step_s", "must be a finite number"))
        elif not 0 < value <= MAX_SECONDS:
            problems.append(
                ("max_step_s", f"must be above 0 and at most {MAX_SECONDS:g} s")
            )
        else:
            max_step_s = float(value)
    thresholds = GuardThresholds()
    if "thresholds" in data:
        parsed_thresholds, threshold_errors = threshold_problems(
            data["thresholds"], "thresholds."
        )
        problems.extend(threshold_errors)
        thresholds = parsed_thresholds or thresholds
    judge, judge_problems = _parse_judge(data.get("judge"))
    problems.extend(judge_problems)
    if problems:
        raise PlanError(problems)
    return RolloutPlan(
        steps=steps,
        retention_s=retention_s,
        thresholds=thresholds,
        max_step_s=max_step_s,
        judge=judge,
    )


def _parse_steps(
    raw: object,
) -> tuple[tuple[StepSpec, ...] | None, list[tuple[str, str]]]:
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        return None, [("steps", "must be a list")]
    problems: list[tuple[str, str]] = []
    steps: list[StepSpec] = []
    for index, item in enumerate(raw):
        step, step_problems = _parse_step(item, f"steps[{index}]")
        problems.extend(step_problems)
        if step is not None:
            steps.append(step)
    if problems:
        return None, problems
    seen_canary: StepSpec | None = None
    for index, step in enumerate(steps):
        if step.stage is Stage.SHADOW:
            if seen_canary is not None:
                problems.append(
                    (
                        f"steps[{index}].stage",
                        "shadow steps must come before canary steps",
                    )
                )
            continue
        if seen_canary is not None and step.percent <= seen_canary.percent:
            problems.append(
                (
                    f"steps[{index}].percent",
                    f"must be above the previous canary step's {seen_canary.percent:g}%",
                )
            )
        seen_canary = step
    if seen_canary is None:
        problems.append(("steps", "needs at least one canary step"))
    return (None, problems) if problems else (tuple(steps), [])


def _parse_step(item: object, at: str) -> tuple[StepSpec | None, list[tuple[str, str]]]:
    if not isinstance(item, Mapping):
        return None, [(at, "must be an object")]
    problems: list[tuple[str, str]] = [
        (f"{at}.{key}", "unknown key") for key in item if key not in _STEP_KEYS
    ]
    stage: Stage | None = None
    if "stage" not in item:
        problems.append((f"{at}.stage", "is required"))
    elif not isinstance(item["stage"], str) or item["stage"] not in set(Stage):
        problems.append((f"{at}.stage", f"must be one of {[s.value for s in Stage]}"))
    else:
        stage = Stage(item["stage"])
    percent: float | None = None
    if "percent" not in item:
        problems.append((f"{at}.percent", "is required"))
    elif not is_finite_number(item["percent"]):
        problems.append((f"{at}.percent", "must be a finite number"))
    elif not 0.0 < item["percent"] <= 100.0:
        problems.append((f"{at}.percent", "must be greater than 0 and at most 100"))
    else:
        percent = float(item["percent"])
    min_duration_s = float(STEP_DEFAULTS["min_duration_s"])
    if "min_duration_s" in item:
        value = item["min_duration_s"]
        if not is_finite_number(value):
            problems.append((f"{at}.min_duration_s", "must be a finite number"))
        elif value < 0:
            problems.append((f"{at}.min_duration_s", "must not be negative"))
        elif value > MAX_SECONDS:
            problems.append(
                (f"{at}.min_duration_s", f"must be at most {MAX_SECONDS:g} s")
            )
        else:
            min_duration_s = float(value)
    counts: dict[str, int] = {}
    for key in ("min_requests", "min_conversations"):
        value = item.get(key, STEP_DEFAULTS[key])
        if not isinstance(value, int) or isinstance(value, bool):
            problems.append((f"{at}.{key}", "must be a whole number"))
        elif value < 0:
            problems.append((f"{at}.{key}", "must not be negative"))
        else:
            counts[key] = value
    needs_approval = item.get("needs_approval", False)
    if not isinstance(needs_approval, bool):
        problems.append((f"{at}.needs_approval", "must be true or false"))
    if problems or stage is None or percent is None:
        return None, problems
    return (
        StepSpec(
            stage=stage,
            percent=percent,
            min_duration_s=min_duration_s,
            min_requests=counts["min_requests"],
            min_conversations=counts["min_conversations"],
            needs_approval=needs_approval,
        ),
        [],
    )


@dataclass(frozen=True, slots=True)
class PlanState:
    """Where a running plan stands: its step and since when (unix seconds).

    ``approved_step``: the step an admin approved (approval is per step, so an
    approval of step 1 does not carry over to step 2).
    """

    step: int
    step_started_at: float
    paused: bool = False
    approved_step: int | None = None


@dataclass(frozen=True, slots=True)
class StepDecision:
    """One evaluation's decision and why.

    ``next_step``: for ``advance``, the index of the next step, or None for a
    promotion (the alias moves to the candidate); None for every other action.
    """

    action: GuardAction
    reason: str
    next_step: int | None = None
    # A hold that raises the step's share (within the plan's limits) says to what.
    percent: float | None = None
    # The expected seconds until every guard decides at this share; None when
    # all have decided, or when the traffic or the rates give no estimate.
    expected_decision_s: float | None = None

    @property
    def promote(self) -> bool:
        """Whether the alias moves to the candidate now."""
        return self.action is GuardAction.ADVANCE and self.next_step is None

    def to_json(self) -> dict[str, object]:
        """Return the decision as JSON."""
        return {
            "action": self.action.value,
            "reason": self.reason,
            "next_step": self.next_step,
            "promote": self.promote,
            "percent": self.percent,
            "expected_decision_s": self.expected_decision_s,
        }


def _roll_back(report: GuardReport) -> StepDecision:
    return StepDecision(
        GuardAction.ROLL_BACK,
        "rolled back: " + "; ".join(f"{r.name}: {r.reason}" for r in report.tripped),
    )


def decide_step(
    plan: RolloutPlan,
    state: PlanState,
    report: GuardReport,
    *,
    now: float,
    requests: int,
    conversations: int,
    percent: float | None = None,
    pool_rps: float | None = None,
    guard_period_s: float = 60.0,
) -> StepDecision:
    """Return what the plan does now, given the latest guard report.

    ``requests`` and ``conversations``: the candidate's in this step so far.
    ``percent``: the step's share now (the spec's unless raised); ``pool_rps``:
    the pool's requests per second (None: unknown, the share is never raised).
    The order of the checks is the module docstring's.

    Raises:
        ValueError: ``state.step`` is not a step of ``plan`` (and nothing tripped).
    """
    if report.tripped:
        return _roll_back(report)
    if not 0 <= state.step < len(plan.steps):
        raise ValueError(f"step {state.step} is not in a plan of {len(plan.steps)}")
    if state.paused:
        return StepDecision(GuardAction.HOLD, "paused by an admin")
    spec = plan.steps[state.step]
    share = spec.percent if percent is None else percent
    elapsed_s = max(0.0, now - state.step_started_at)
    expected_s = expected_decision_s(report, share, pool_rps, requests, elapsed_s)
    if pool_rps is not None:
        raised = exposure_percent(
            plan, state.step, share, pool_rps, guard_period_s, report
        )
        # A tenth or more: the pool's rate moves a little every period.
        if raised > share * 1.1:
            return StepDecision(
                GuardAction.HOLD,
                f"raising {spec.label} to {raised:.3g}%: at {pool_rps:.3g} "
                f"requests/s the pool is too quiet for a decision at "
                f"{share:g}% within {plan.max_step_s:g} s (or a total failure "
                f"within {DETECTION_PERIODS} guard periods)",
                percent=raised,
                expected_decision_s=expected_decision_s(
                    report, raised, pool_rps, requests, elapsed_s
                ),
            )
    waits: list[str] = []
    if elapsed_s < spec.min_duration_s:
        waits.append(
            f"{spec.min_duration_s:g} s in {spec.label} ({elapsed_s:.0f} s so far)"
        )
    if requests < spec.min_requests:
        waits.append(f"{spec.min_requests} requests ({requests} so far)")
    if conversations < spec.min_conversations:
        waits.append(f"{spec.min_conversations} conversations ({conversations} so far)")
    if waits:
        return StepDecision(
            GuardAction.CONTINUE,
            "waiting for " + ", ".join(waits),
            expected_decision_s=expected_s,
        )
    lacking = [
        r
        for r in report.undecided
        if not _unobserved_in_shadow(spec, r, report, plan.thresholds.min_samples)
    ]
    if lacking:
        until = (
            f" (a decision expected in about {expected_s:.0f} s)"
            if expected_s is not None
            else ""
        )
        return StepDecision(
            GuardAction.HOLD,
            f"holding, extending {spec.label} at {share:g}%{until}: "
            + "; ".join(r.reason for r in lacking),
            expected_decision_s=expected_s,
        )
    if spec.needs_approval and state.approved_step != state.step:
        return StepDecision(
            GuardAction.HOLD, f"waiting for an admin's approval of {spec.label}"
        )
    done = (
        f"every guard not worse after {elapsed_s:.0f} s, {requests} requests and "
        f"{conversations} conversations in {spec.label}"
    )
    following = state.step + 1
    if following < len(plan.steps):
        return StepDecision(
            GuardAction.ADVANCE,
            f"{done}: on to {plan.steps[following].label}",
            following,
        )
    return StepDecision(GuardAction.ADVANCE, f"{done}: promote", None)


def expected_decision_s(
    report: GuardReport,
    percent: float,
    pool_rps: float | None,
    requests: int,
    elapsed_s: float,
) -> float | None:
    """Return the expected seconds until every undecided guard decides.

    Each guard's ``samples_needed`` (at the rates seen so far) less what it has,
    over the candidate's request rate: the pool's at ``percent``, else the rate
    seen in the step. None when nothing is undecided or no estimate exists.
    """
    rate = (
        pool_rps * percent / 100.0
        if pool_rps is not None
        else (requests / elapsed_s if elapsed_s > 0 else 0.0)
    )
    waits: list[float] = []
    for result in report.undecided:
        if result.samples_needed is None or rate <= 0.0:
            return None
        waits.append(max(0.0, result.samples_needed - result.candidate_samples) / rate)
    return max(waits) if waits else None


def step_share(
    plan: RolloutPlan,
    step: int,
    pool_rps: float | None,
    guard_period_s: float,
    report: GuardReport | None = None,
) -> float:
    """Return the share step ``step`` begins at: its own, raised for a quiet pool
    (``exposure_percent``); its own when the pool's traffic is unknown."""
    spec = plan.steps[step]
    if pool_rps is None:
        return spec.percent
    return exposure_percent(plan, step, spec.percent, pool_rps, guard_period_s, report)


def _live_rate(report: GuardReport | None, name: str, default: float) -> float:
    if report is None:
        return default
    try:
        live = report.result(name).live
    except KeyError:
        return default
    return default if live is None or report.result(name).live_samples < 100 else live


def exposure_percent(
    plan: RolloutPlan,
    step: int,
    percent: float,
    pool_rps: float,
    guard_period_s: float,
    report: GuardReport | None = None,
) -> float:
    """Return the share step ``step`` needs at ``pool_rps`` (at least ``percent``).

    Two needs, from the thresholds: a total failure (every answer an error or a
    refusal) shown worse within ``DETECTION_PERIODS`` guard periods, with
    ``EXPOSURE_MARGIN`` for the ramp (only new conversations reach a canary) and
    chance; and a candidate like live shown not worse within ``max_step_s``.
    Capped by the plan's limits: a canary step at the next canary step's share
    (the last one at its own), a shadow step at the plan's largest canary share.
    """
    spec = plan.steps[step]
    canaries = [s.percent for s in plan.steps if s.stage is Stage.CANARY]
    later = [s.percent for s in plan.steps[step + 1 :] if s.stage is Stage.CANARY]
    if spec.stage is Stage.SHADOW:
        cap = max(canaries, default=spec.percent)
    else:
        cap = later[0] if later else spec.percent
    cap = max(cap, percent)
    if pool_rps <= 0.0:
        return cap
    t = plan.thresholds
    total_failure = max(
        samples_for_total_failure(t.error_rate_points, t.alpha),
        samples_for_total_failure(t.refusal_rate_points, t.alpha),
    )
    detect = EXPOSURE_MARGIN * total_failure / (DETECTION_PERIODS * guard_period_s)
    live_rate = _live_rate(report, "error_rate", ASSUMED_ERROR_RATE)
    not_worse = (
        samples_for_not_worse(t.error_rate_points, t.alpha, round(live_rate, 4))
        / plan.max_step_s
    )
    needed = 100.0 * max(detect, not_worse) / pool_rps
    return min(cap, max(percent, needed))


@functools.lru_cache(maxsize=256)
def samples_for_total_failure(limit_points: float, alpha: float) -> int:
    """Return the candidate samples that show a rate of 100% worse than live's 0%
    by more than ``limit_points`` (as many on live)."""
    limit = limit_points / 100.0
    needed = sequential.samples_to_decide(
        1.0, 0.0, limit, alpha=alpha, scales=sequential.rate_scales(limit)
    )
    return needed if needed is not None else 1


@functools.lru_cache(maxsize=256)
def samples_for_not_worse(limit_points: float, alpha: float, rate: float) -> int:
    """Return the candidate samples that show a candidate at live's ``rate`` not
    worse than live by ``limit_points`` (as many on live)."""
    limit = limit_points / 100.0
    needed = sequential.samples_to_decide(
        rate, rate, limit, alpha=alpha, scales=sequential.rate_scales(limit)
    )
    return needed if needed is not None else 10_000_000


def _unobserved_in_shadow(
    spec: StepSpec, result: GuardResult, report: GuardReport, plan_min_samples: int
) -> bool:
    """Whether a ``too_few`` guard is excused in a shadow step (module docstring)."""
    if spec.stage is not Stage.SHADOW or result.name == "p95_ttft":
        return False
    ttft = next((r for r in report.results if r.name == "p95_ttft"), None)
    return (
        result.candidate_samples == 0
        and result.live_samples >= plan_min_samples
        and ttft is not None
        and ttft.verdict is not Verdict.TOO_FEW
    )


def decide_manual(report: GuardReport) -> StepDecision:
    """Return the decision for a manual rollout: roll back on a trip, else continue.

    A manual rollout never advances by itself; an admin moves it.
    """
    if report.tripped:
        return _roll_back(report)
    return StepDecision(GuardAction.CONTINUE, f"manual rollout: {report.summary()}")
