"""The stages of a rollout, its plan, and the plan's state machine.

Public surface: ``Stage``, ``Decision``, ``CANARY_STEPS``, ``GuardThresholds``
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

1. a tripped guard rolls back, paused or not: a guard always protects users;
2. a paused rollout holds;
3. a step short of its minimums continues (and says what it waits for);
4. a guard without enough samples holds: no decision on too few samples;
5. a step that needs approval holds until the admin approves this step;
6. else advance to the next step, or promote after the last.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    "CANARY_STEPS",
    "DEFAULT_PLAN",
    "STEP_DEFAULTS",
    "Decision",
    "GuardAction",
    "GuardThresholds",
    "PlanError",
    "PlanState",
    "RolloutPlan",
    "Stage",
    "StepDecision",
    "StepSpec",
    "decide_manual",
    "decide_step",
    "parse_plan",
    "stage_errors",
]

CANARY_STEPS: tuple[float, ...] = (1.0, 10.0, 50.0)


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
class RolloutPlan:
    """A model's rollout plan: its steps, the old version's retention, the guards.

    Build one with ``parse_plan`` (which validates); the dataclass itself does not.
    """

    steps: tuple[StepSpec, ...] = field(default_factory=_default_steps)
    retention_s: float = 86400.0
    thresholds: GuardThresholds = field(default_factory=GuardThresholds)

    def to_json(self) -> dict[str, object]:
        """Return the plan as JSON (``parse_plan`` reads it back equal)."""
        return {
            "steps": [step.to_json() for step in self.steps],
            "retention_s": self.retention_s,
            "thresholds": self.thresholds.to_json(),
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

_PLAN_KEYS = ("steps", "retention_s", "thresholds")
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
    thresholds = GuardThresholds()
    if "thresholds" in data:
        parsed_thresholds, threshold_errors = threshold_problems(
            data["thresholds"], "thresholds."
        )
        problems.extend(threshold_errors)
        thresholds = parsed_thresholds or thresholds
    if problems:
        raise PlanError(problems)
    return RolloutPlan(steps=steps, retention_s=retention_s, thresholds=thresholds)


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
) -> StepDecision:
    """Return what the plan does now, given the latest guard report.

    ``requests`` and ``conversations``: the candidate's in this step so far.
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
    elapsed_s = max(0.0, now - state.step_started_at)
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
        return StepDecision(GuardAction.CONTINUE, "waiting for " + ", ".join(waits))
    lacking = [
        r
        for r in report.too_few
        if not _unobserved_in_shadow(spec, r, report, plan.thresholds.min_samples)
    ]
    if lacking:
        return StepDecision(
            GuardAction.HOLD, "holding: " + "; ".join(r.reason for r in lacking)
        )
    if spec.needs_approval and state.approved_step != state.step:
        return StepDecision(
            GuardAction.HOLD, f"waiting for an admin's approval of {spec.label}"
        )
    done = (
        f"guards pass after {elapsed_s:.0f} s, {requests} requests and "
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
