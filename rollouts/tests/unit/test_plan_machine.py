"""Tests for rollout plans: parsing, and the state machine that runs them."""

from __future__ import annotations

import math
from typing import Any, TypedDict

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from metering.domain.figures import VersionFigures, one_request
from rollouts.domain.guards import (
    GUARD_NAMES,
    GuardReport,
    GuardResult,
    GuardThresholds,
    Verdict,
    compare,
)
from rollouts.domain.plan import (
    CANARY_STEPS,
    DEFAULT_PLAN,
    GuardAction,
    PlanError,
    PlanState,
    RolloutPlan,
    Stage,
    StepDecision,
    StepSpec,
    decide_manual,
    decide_step,
    parse_plan,
)

T0 = 1_700_000_000.0
PROPERTY = settings(max_examples=150, deadline=None)


# ---------------------------------------------------------------------------
# Building plans and reports


def result(
    name: str,
    verdict: Verdict,
    *,
    candidate_samples: int = 500,
    live_samples: int = 5000,
) -> GuardResult:
    return GuardResult(
        name=name,
        verdict=verdict,
        candidate=0.0,
        live=0.0,
        change=0.0,
        p_value=None if verdict is Verdict.TOO_FEW else 0.5,
        reason=f"{name} is {verdict.value}",
        candidate_samples=candidate_samples,
        live_samples=live_samples,
    )


def report(**overrides: Verdict) -> GuardReport:
    """Every guard passes unless overridden by name."""
    return GuardReport(
        results=tuple(
            result(name, overrides.get(name, Verdict.PASS)) for name in GUARD_NAMES
        ),
        candidate_requests=500,
        live_requests=5000,
    )


PASSING = report()

verdict_st = st.sampled_from(list(Verdict))
reports = st.builds(
    lambda vs: GuardReport(
        results=tuple(result(n, v) for n, v in zip(GUARD_NAMES, vs, strict=True)),
        candidate_requests=500,
        live_requests=5000,
    ),
    st.tuples(*(verdict_st for _ in GUARD_NAMES)),
)


@st.composite
def plans(draw: st.DrawFn) -> RolloutPlan:
    """Valid plans: shadow steps first, canary shares strictly rising."""
    share = st.floats(0.0, 100.0, exclude_min=True)
    shadows = draw(st.lists(share, max_size=2))
    canaries = sorted(draw(st.lists(share, min_size=1, max_size=4, unique=True)))

    def step(stage: Stage, percent: float) -> StepSpec:
        return StepSpec(
            stage=stage,
            percent=percent,
            min_duration_s=draw(st.floats(0, 1e6)),
            min_requests=draw(st.integers(0, 10**6)),
            min_conversations=draw(st.integers(0, 10**6)),
            needs_approval=draw(st.booleans()),
        )

    steps = [step(Stage.SHADOW, p) for p in shadows]
    steps += [step(Stage.CANARY, p) for p in canaries]
    thresholds = GuardThresholds(
        error_rate_points=draw(st.floats(0, 100)),
        p95_ttft_ratio=draw(st.floats(0, 5)),
        output_length_ratio=draw(st.floats(0, 5)),
        refusal_rate_points=draw(st.floats(0, 100)),
        alpha=draw(st.floats(1e-6, 0.5)),
        min_samples=draw(st.integers(1, 1000)),
    )
    return RolloutPlan(
        steps=tuple(steps),
        retention_s=draw(st.floats(0, 1e7)),
        thresholds=thresholds,
    )


@st.composite
def plan_and_state(draw: st.DrawFn) -> tuple[RolloutPlan, PlanState]:
    plan = draw(plans())
    step = draw(st.integers(0, len(plan.steps) - 1))
    state = PlanState(
        step=step,
        step_started_at=T0,
        paused=draw(st.booleans()),
        approved_step=draw(st.none() | st.integers(0, len(plan.steps))),
    )
    return plan, state


def problems_of(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(PlanError) as caught:
        parse_plan(data)
    return caught.value.problems


class Ready(TypedDict):
    now: float
    requests: int
    conversations: int


def ready(plan: RolloutPlan, step: int) -> Ready:
    """``now``, ``requests`` and ``conversations`` that meet ``step``'s minimums."""
    spec = plan.steps[step]
    return Ready(
        now=T0 + spec.min_duration_s + 1.0,  # + 1 s: no float rounding below
        requests=spec.min_requests,
        conversations=spec.min_conversations,
    )


# ---------------------------------------------------------------------------
# Plans


def test_default_plan_is_shadow_then_canary_1_10_50() -> None:
    assert [(s.stage, s.percent) for s in DEFAULT_PLAN.steps] == [
        (Stage.SHADOW, 1.0),
        (Stage.CANARY, 1.0),
        (Stage.CANARY, 10.0),
        (Stage.CANARY, 50.0),
    ]
    assert [
        (s.min_duration_s, s.min_requests, s.min_conversations)
        for s in DEFAULT_PLAN.steps
    ] == [(600.0, 200, 50), (600.0, 200, 50), (600.0, 1000, 200), (600.0, 2000, 500)]
    assert not any(s.needs_approval for s in DEFAULT_PLAN.steps)
    assert DEFAULT_PLAN.retention_s == 24 * 3600
    assert DEFAULT_PLAN.thresholds == GuardThresholds()
    canary = tuple(s.percent for s in DEFAULT_PLAN.steps if s.stage is Stage.CANARY)
    assert canary == CANARY_STEPS


def test_parse_plan_missing_keys_take_defaults() -> None:
    assert parse_plan({}) == DEFAULT_PLAN
    assert parse_plan({"retention_s": 60}) == RolloutPlan(
        steps=DEFAULT_PLAN.steps, retention_s=60.0
    )
    plan = parse_plan(
        {"steps": [{"stage": "canary", "percent": 5}], "thresholds": {"alpha": 0.05}}
    )
    assert plan.steps == (StepSpec(Stage.CANARY, 5.0, 600.0, 200, 50),)
    assert plan.thresholds == GuardThresholds(alpha=0.05)


@PROPERTY
@given(plans())
def test_parse_plan_reads_back_to_json(plan: RolloutPlan) -> None:
    assert parse_plan(plan.to_json()) == plan


def test_parse_plan_to_json_of_the_default() -> None:
    data = DEFAULT_PLAN.to_json()
    assert data["retention_s"] == 86400.0
    steps = data["steps"]
    assert isinstance(steps, list)
    assert steps[0] == {
        "stage": "shadow",
        "percent": 1.0,
        "min_duration_s": 600.0,
        "min_requests": 200,
        "min_conversations": 50,
        "needs_approval": False,
    }


CANARY_1 = {"stage": "canary", "percent": 1}
CANARY_10 = {"stage": "canary", "percent": 10}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"bogus": 1}, [("bogus", "unknown key")]),
        ({"steps": "canary"}, [("steps", "must be a list")]),
        ({"steps": {"stage": "canary"}}, [("steps", "must be a list")]),
        ({"steps": []}, [("steps", "needs at least one canary step")]),
        (
            {"steps": [{"stage": "shadow", "percent": 1}]},
            [("steps", "needs at least one canary step")],
        ),
        ({"steps": [CANARY_1, 3]}, [("steps[1]", "must be an object")]),
        (
            {"steps": [CANARY_1, {"stage": "canary", "percent": 10, "x": 1}]},
            [("steps[1].x", "unknown key")],
        ),
        ({"steps": [{"percent": 1}]}, [("steps[0].stage", "is required")]),
        ({"steps": [{"stage": "canary"}]}, [("steps[0].percent", "is required")]),
        (
            {"steps": [{"stage": "live", "percent": 1}]},
            [("steps[0].stage", "must be one of ['shadow', 'canary']")],
        ),
        (
            {"steps": [{"stage": "canary", "percent": True}]},
            [("steps[0].percent", "must be a finite number")],
        ),
        (
            {"steps": [{"stage": "canary", "percent": math.inf}]},
            [("steps[0].percent", "must be a finite number")],
        ),
        (
            {"steps": [CANARY_1, CANARY_10, {"stage": "canary", "percent": 0}]},
            [("steps[2].percent", "must be greater than 0 and at most 100")],
        ),
        (
            {"steps": [CANARY_1, {"stage": "canary", "percent": 100.5}]},
            [("steps[1].percent", "must be greater than 0 and at most 100")],
        ),
        (
            {"steps": [CANARY_1, CANARY_10, {"stage": "canary", "percent": 10}]},
            [("steps[2].percent", "must be above the previous canary step's 10%")],
        ),
        (
            {"steps": [CANARY_10, CANARY_1]},
            [("steps[1].percent", "must be above the previous canary step's 10%")],
        ),
        (
            {"steps": [CANARY_1, {"stage": "shadow", "percent": 1}, CANARY_10]},
            [("steps[1].stage", "shadow steps must come before canary steps")],
        ),
        (
            {"steps": [{**CANARY_1, "min_requests": -1}]},
            [("steps[0].min_requests", "must not be negative")],
        ),
        (
            {"steps": [{**CANARY_1, "min_conversations": 2.5}]},
            [("steps[0].min_conversations", "must be a whole number")],
        ),
        (
            {"steps": [{**CANARY_1, "min_requests": True}]},
            [("steps[0].min_requests", "must be a whole number")],
        ),
        (
            {"steps": [{**CANARY_1, "min_duration_s": -5}]},
            [("steps[0].min_duration_s", "must not be negative")],
        ),
        (
            {"steps": [{**CANARY_1, "min_duration_s": False}]},
            [("steps[0].min_duration_s", "must be a finite number")],
        ),
        (
            {"steps": [{**CANARY_1, "needs_approval": "yes"}]},
            [("steps[0].needs_approval", "must be true or false")],
        ),
        ({"retention_s": -1}, [("retention_s", "must not be negative")]),
        ({"retention_s": True}, [("retention_s", "must be a finite number")]),
        ({"retention_s": 10**400}, [("retention_s", "must be a finite number")]),
        ({"thresholds": []}, [("thresholds", "must be an object")]),
        (
            {"thresholds": {"alpha": 2, "bogus": 1}},
            [
                ("thresholds.bogus", "unknown key"),
                ("thresholds.alpha", "must be greater than 0 and less than 1"),
            ],
        ),
        (
            {"x": 1, "retention_s": -1, "thresholds": {"min_samples": 0}},
            [
                ("x", "unknown key"),
                ("retention_s", "must not be negative"),
                ("thresholds.min_samples", "must be at least 1"),
            ],
        ),
    ],
)
def test_parse_plan_rejects_invalid_plans(
    data: dict[str, Any], expected: list[tuple[str, str]]
) -> None:
    assert problems_of(data) == expected


def test_plan_error_message_names_every_problem() -> None:
    with pytest.raises(
        PlanError, match=r"^x: unknown key; retention_s: must not be negative$"
    ):
        parse_plan({"retention_s": -1, "x": 1})


# ---------------------------------------------------------------------------
# The machine: invariants


@PROPERTY
@given(plan_and_state(), reports, st.floats(-1e3, 1e7), st.integers(0, 10**7))
def test_decide_step_a_trip_always_rolls_back(
    plan_state: tuple[RolloutPlan, PlanState],
    base: GuardReport,
    elapsed_s: float,
    count: int,
) -> None:
    plan, state = plan_state
    tripped = GuardReport(
        results=(result("error_rate", Verdict.TRIP), *base.results[1:]),
        candidate_requests=1,
        live_requests=1,
    )
    decision = decide_step(
        plan, state, tripped, now=T0 + elapsed_s, requests=count, conversations=count
    )
    assert decision.action is GuardAction.ROLL_BACK
    assert decision.next_step is None and not decision.promote
    assert "error_rate" in decision.reason


@PROPERTY
@given(plan_and_state(), reports, st.floats(-1e3, 1e7), st.integers(0, 10**7))
def test_decide_step_never_advances_while_paused(
    plan_state: tuple[RolloutPlan, PlanState],
    guards: GuardReport,
    elapsed_s: float,
    count: int,
) -> None:
    plan, state = plan_state
    paused = PlanState(state.step, state.step_started_at, True, state.approved_step)
    decision = decide_step(
        plan, paused, guards, now=T0 + elapsed_s, requests=count, conversations=count
    )
    assert decision.action is not GuardAction.ADVANCE
    if not guards.tripped:
        assert decision == StepDecision(GuardAction.HOLD, "paused by an admin")


@PROPERTY
@given(
    plan_and_state(),
    reports,
    st.floats(0, 1e7),
    st.integers(0, 10**7),
    st.integers(0, 10**7),
)
def test_decide_step_never_advances_before_the_minimums(
    plan_state: tuple[RolloutPlan, PlanState],
    guards: GuardReport,
    elapsed_s: float,
    requests: int,
    conversations: int,
) -> None:
    plan, state = plan_state
    decision = decide_step(
        plan,
        state,
        guards,
        now=T0 + elapsed_s,
        requests=requests,
        conversations=conversations,
    )
    spec = plan.steps[state.step]
    event(decision.action.value)
    if decision.action is GuardAction.ADVANCE:
        assert (T0 + elapsed_s) - state.step_started_at >= spec.min_duration_s
        assert requests >= spec.min_requests
        assert conversations >= spec.min_conversations
        assert not state.paused and not guards.tripped and not guards.undecided
        assert not spec.needs_approval or state.approved_step == state.step
        expected = state.step + 1 if state.step + 1 < len(plan.steps) else None
        assert decision.next_step == expected
        assert decision.promote is (expected is None)
    else:
        assert decision.next_step is None and not decision.promote


@PROPERTY
@given(plan_and_state())
def test_decide_step_advances_one_step_when_all_is_met(
    plan_state: tuple[RolloutPlan, PlanState],
) -> None:
    plan, state = plan_state
    state = PlanState(state.step, T0, paused=False, approved_step=state.step)
    decision = decide_step(plan, state, PASSING, **ready(plan, state.step))
    assert decision.action is GuardAction.ADVANCE
    last = state.step == len(plan.steps) - 1
    assert decision.promote is last
    assert decision.next_step == (None if last else state.step + 1)


# ---------------------------------------------------------------------------
# The machine: cases


def test_decide_step_walks_the_default_plan_to_promotion() -> None:
    plan, step, started = DEFAULT_PLAN, 0, T0
    seen: list[int | None] = []
    while True:
        spec = plan.steps[step]
        state = PlanState(step=step, step_started_at=started)
        now = started + spec.min_duration_s
        decision = decide_step(
            plan,
            state,
            PASSING,
            now=now,
            requests=spec.min_requests,
            conversations=spec.min_conversations,
        )
        assert decision.action is GuardAction.ADVANCE, decision.reason
        seen.append(decision.next_step)
        if decision.promote:
            break
        assert decision.next_step is not None
        step, started = decision.next_step, now
    assert seen == [1, 2, 3, None]
    assert decision.reason == (
        "every guard not worse after 600 s, 2000 requests and 500 conversations in "
        "canary 50%: promote"
    )


def test_decide_step_continue_says_what_it_waits_for() -> None:
    state = PlanState(step=2, step_started_at=T0)
    decision = decide_step(
        DEFAULT_PLAN, state, PASSING, now=T0 + 120, requests=350, conversations=80
    )
    assert decision == StepDecision(
        GuardAction.CONTINUE,
        "waiting for 600 s in canary 10% (120 s so far), 1000 requests (350 so far), "
        "200 conversations (80 so far)",
    )
    only_time = decide_step(
        DEFAULT_PLAN, state, PASSING, now=T0 + 599.5, requests=1000, conversations=200
    )
    assert only_time.action is GuardAction.CONTINUE
    assert only_time.reason.startswith("waiting for 600 s in canary 10%")
    assert "requests" not in only_time.reason


def test_decide_step_rolls_back_when_paused_and_names_the_figures() -> None:
    live = VersionFigures()
    for i in range(200):
        live += one_request(ttft_s=0.2 + i / 1000, output_tokens=150 + i)
    canary = VersionFigures()
    for _ in range(30):
        canary += one_request(ttft_s=0.25, output_tokens=12, refused=True)
    guards = compare(canary, live, DEFAULT_PLAN.thresholds)
    state = PlanState(step=1, step_started_at=T0, paused=True)
    decision = decide_step(
        DEFAULT_PLAN, state, guards, now=T0 + 60, requests=30, conversations=30
    )
    assert decision.action is GuardAction.ROLL_BACK
    assert decision.reason.startswith("rolled back: output_length: average output 12.0")
    assert "; refusal_rate: refusal rate 100.0% against 0.0% on live" in decision.reason


def test_decide_step_holds_on_too_few_samples_naming_the_guard() -> None:
    state = PlanState(step=1, step_started_at=T0)
    decision = decide_step(
        DEFAULT_PLAN,
        state,
        report(p95_ttft=Verdict.TOO_FEW),
        **ready(DEFAULT_PLAN, 1),
    )
    assert decision == StepDecision(
        GuardAction.HOLD, "holding, extending canary 1% at 1%: p95_ttft is too_few"
    )


def test_decide_step_holds_for_approval_of_this_very_step() -> None:
    steps = (
        StepSpec(Stage.CANARY, 1.0, 0.0, 0, 0),
        StepSpec(Stage.CANARY, 10.0, 0.0, 0, 0, needs_approval=True),
    )
    plan = RolloutPlan(steps=steps)
    waiting = decide_step(
        plan,
        PlanState(1, T0, approved_step=0),
        PASSING,
        now=T0,
        requests=0,
        conversations=0,
    )
    assert waiting == StepDecision(
        GuardAction.HOLD, "waiting for an admin's approval of canary 10%"
    )
    approved = decide_step(
        plan,
        PlanState(1, T0, approved_step=1),
        PASSING,
        now=T0,
        requests=0,
        conversations=0,
    )
    assert approved.action is GuardAction.ADVANCE and approved.promote
    # Too few samples is reported before approval: approving cannot skip the guards.
    lacking = decide_step(
        plan,
        PlanState(1, T0, approved_step=1),
        report(error_rate=Verdict.TOO_FEW),
        now=T0,
        requests=0,
        conversations=0,
    )
    assert lacking.action is GuardAction.HOLD
    assert lacking.reason == (
        "holding, extending canary 10% at 10%: error_rate is too_few"
    )


def _shadow_report(**candidate_samples: int) -> GuardReport:
    """Guards with ``candidate_samples`` (default 500) per guard name; a guard
    with fewer than 20 is too few."""
    results = []
    for name in GUARD_NAMES:
        n = candidate_samples.get(name, 500)
        verdict = Verdict.TOO_FEW if n < 20 else Verdict.PASS
        results.append(result(name, verdict, candidate_samples=n))
    return GuardReport(tuple(results), candidate_requests=500, live_requests=5000)


def test_decide_step_shadow_excuses_unobserved_answers_but_not_latency() -> None:
    shadow = PlanState(step=0, step_started_at=T0)
    args = ready(DEFAULT_PLAN, 0)
    # The gateway read shadow copies only to the first token: no answers at all.
    unobserved = _shadow_report(output_length=0, refusal_rate=0)
    assert decide_step(DEFAULT_PLAN, shadow, unobserved, **args).next_step == 1
    # Some answers, below the minimum: too few, not unobserved.
    assert (
        decide_step(
            DEFAULT_PLAN, shadow, _shadow_report(output_length=5), **args
        ).action
        is GuardAction.HOLD
    )
    # No TTFT either: the shadow is broken, not unobserved.
    broken = _shadow_report(p95_ttft=0, output_length=0, refusal_rate=0)
    decision = decide_step(DEFAULT_PLAN, shadow, broken, **args)
    assert decision.action is GuardAction.HOLD
    assert "p95_ttft" in decision.reason
    # A canary gets no such excuse.
    canary = PlanState(step=1, step_started_at=T0)
    assert (
        decide_step(DEFAULT_PLAN, canary, unobserved, **ready(DEFAULT_PLAN, 1)).action
        is GuardAction.HOLD
    )


def test_decide_step_rejects_a_step_outside_the_plan() -> None:
    with pytest.raises(ValueError, match="step 4 is not in a plan of 4"):
        decide_step(
            DEFAULT_PLAN,
            PlanState(4, T0),
            PASSING,
            now=T0,
            requests=0,
            conversations=0,
        )


@given(reports)
def test_decide_manual_rolls_back_on_a_trip_and_never_advances(
    guards: GuardReport,
) -> None:
    decision = decide_manual(guards)
    if guards.tripped:
        assert decision.action is GuardAction.ROLL_BACK
        assert all(r.name in decision.reason for r in guards.tripped)
    else:
        assert decision.action is GuardAction.CONTINUE
        assert decision.reason == f"manual rollout: {guards.summary()}"
    assert decision.next_step is None and not decision.promote


def test_step_decision_json() -> None:
    promote = StepDecision(GuardAction.ADVANCE, "promote", None)
    assert promote.to_json() == {
        "action": "advance",
        "reason": "promote",
        "next_step": None,
        "promote": True,
        "percent": None,
        "expected_decision_s": None,
    }
    assert not StepDecision(GuardAction.ADVANCE, "next", 2).promote


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"retention_s": 1e12}, "retention_s"),
        (
            {"steps": [{"stage": "canary", "percent": 1, "min_duration_s": 1e12}]},
            "steps[0].min_duration_s",
        ),
    ],
)
def test_a_plan_may_not_wait_past_a_year(data: dict[str, Any], param: str) -> None:
    with pytest.raises(PlanError) as caught:
        parse_plan(data)
    assert [p for p, _ in caught.value.problems] == [param]


def test_exposure_follows_the_pools_traffic_within_the_plans_limits() -> None:
    """The default plan's canary 1%: kept at 1,000 streams' 100 requests/s up
    to what a decision within ``max_step_s`` needs, raised for 10 requests/s,
    never past the next step's 10%; the last step is never raised."""
    from rollouts.domain.plan import exposure_percent, step_share

    first = 1  # canary 1%
    busy = exposure_percent(DEFAULT_PLAN, first, 1.0, 100.0, 60.0)
    quiet = exposure_percent(DEFAULT_PLAN, first, 1.0, 10.0, 60.0)
    quietest = exposure_percent(DEFAULT_PLAN, first, 1.0, 0.5, 60.0)
    assert 1.0 <= busy < quiet <= quietest == 10.0
    assert exposure_percent(DEFAULT_PLAN, 3, 50.0, 0.5, 60.0) == 50.0
    assert step_share(DEFAULT_PLAN, first, None, 60.0) == 1.0
    assert step_share(DEFAULT_PLAN, first, 10.0, 60.0) == quiet


def test_decide_step_holds_undecided_guards_with_an_expected_time() -> None:
    from dataclasses import replace

    undecided = report(error_rate=Verdict.UNDECIDED)
    results = tuple(
        replace(r, samples_needed=1000, candidate_samples=400)
        if r.name == "error_rate"
        else r
        for r in undecided.results
    )
    decision = decide_step(
        DEFAULT_PLAN,
        PlanState(step=1, step_started_at=T0),
        replace(undecided, results=results),
        percent=10.0,
        pool_rps=60.0,
        **ready(DEFAULT_PLAN, 1),
    )
    assert decision.action is GuardAction.HOLD
    assert decision.percent is None
    # 600 more requests at 10% of 60 requests/s.
    assert decision.expected_decision_s == pytest.approx(100.0)
    assert decision.reason.startswith("holding, extending canary 1% at 10% (")
