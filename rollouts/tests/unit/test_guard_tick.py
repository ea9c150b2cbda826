"""The guard tick's effects, driven by hand: what it reads, locks, asks and writes."""

from __future__ import annotations

from dataclasses import replace

from metering.domain.figures import Role, VersionFigures, one_request
from rollouts.domain.guard_tick import (
    AdvanceStep,
    Effect,
    GuardedRollout,
    LockRollout,
    Promote,
    ReadFigures,
    ReadGates,
    RecordEvaluation,
    Reply,
    RollBack,
    StayInStep,
    drive,
    guard_tick,
)
from rollouts.domain.plan import GuardAction, Stage, parse_plan

STEP = {"min_duration_s": 60, "min_requests": 20, "min_conversations": 5}
PLAN = parse_plan(
    {
        "steps": [
            {"stage": "shadow", "percent": 5, **STEP},
            {"stage": "canary", "percent": 10, **STEP},
        ],
        "retention_s": 3600,
    }
)
SHADOW = GuardedRollout(
    model="chat-7b",
    candidate="v2",
    live="v1",
    stage=Stage.SHADOW,
    percent=5.0,
    step=0,
    step_started_at=1000.0,
    plan=PLAN,
)
CANARY = replace(SHADOW, stage=Stage.CANARY, percent=10.0, step=1)


def many(n: int, *, output_tokens: int, refused: bool = False) -> VersionFigures:
    total = VersionFigures()
    for i in range(n):
        total += one_request(
            ttft_s=0.2 + (i % 7) * 0.01, output_tokens=output_tokens, refused=refused
        )
    return replace(total, conversations=n // 2)


# Enough for the sequential guards to decide: no error in 1,000 requests a side
# shows the error rate within 0.5 points of live's (about 800 are needed).
GOOD = many(1000, output_tokens=100)
REFUSING = many(100, output_tokens=10, refused=True)


class Driver:
    """Answer every effect from fixed figures; keep what was asked."""

    def __init__(
        self,
        candidate: VersionFigures = GOOD,
        *,
        locks: bool = True,
        refusal: str | None = None,
    ) -> None:
        self.candidate = candidate
        self.locks = locks
        self.refusal = refusal
        self.effects: list[Effect] = []

    def perform(self, effect: Effect) -> Reply:
        self.effects.append(effect)
        if isinstance(effect, ReadFigures):
            return self.candidate if effect.version == "v2" else GOOD
        if isinstance(effect, LockRollout):
            return self.locks
        if isinstance(effect, ReadGates):
            return self.refusal
        return None


def test_guard_tick_reads_a_shadow_against_all_of_live_since_the_step_began() -> None:
    driver = Driver()
    drive(guard_tick(SHADOW, now=1030.0), driver.perform)
    reads = [e for e in driver.effects if isinstance(e, ReadFigures)]
    assert [(r.version, r.role, r.since) for r in reads] == [
        ("v2", Role.SHADOW, 1000.0),
        ("v1", Role.LIVE, 1000.0),
        ("v1", Role.BASELINE, 1000.0),
    ]
    # Too early: recorded, then the step kept.
    assert [type(e) for e in driver.effects[3:]] == [
        LockRollout,
        RecordEvaluation,
        StayInStep,
    ]


def test_guard_tick_reads_a_canary_against_the_baseline_and_nothing_without_live() -> (
    None
):
    driver = Driver()
    drive(guard_tick(CANARY, now=1030.0), driver.perform)
    reads = [(e.version, e.role) for e in driver.effects if isinstance(e, ReadFigures)]
    assert reads == [("v2", Role.CANARY), ("v1", Role.BASELINE)]
    driver = Driver()
    evaluation = drive(
        guard_tick(replace(CANARY, live=None), now=1030.0), driver.perform
    )
    reads = [(e.version, e.role) for e in driver.effects if isinstance(e, ReadFigures)]
    assert reads == [("v2", Role.CANARY)]
    assert evaluation is not None and evaluation.live == VersionFigures()


def test_guard_tick_advances_then_promotes_after_the_last_step() -> None:
    driver = Driver()
    evaluation = drive(guard_tick(SHADOW, now=1061.0), driver.perform)
    assert evaluation is not None
    assert evaluation.decision.action is GuardAction.ADVANCE
    advance = driver.effects[-1]
    assert isinstance(advance, AdvanceStep)
    assert (advance.step, advance.spec) == (1, PLAN.steps[1])
    driver = Driver()
    drive(guard_tick(CANARY, now=1061.0), driver.perform)
    promote = driver.effects[-1]
    assert isinstance(promote, Promote) and promote.retention_s == 3600
    assert any(isinstance(e, ReadGates) for e in driver.effects)


def test_guard_tick_holds_a_promotion_the_gates_refuse() -> None:
    driver = Driver(refusal="chat-7b@v2 was rejected by its gates")
    evaluation = drive(guard_tick(CANARY, now=1061.0), driver.perform)
    assert evaluation is not None
    assert evaluation.decision.action is GuardAction.HOLD
    assert "rejected by its gates" in evaluation.decision.reason
    stay = driver.effects[-1]
    assert isinstance(stay, StayInStep) and stay.reason == evaluation.decision.reason


def test_guard_tick_rolls_back_a_trip_and_writes_nothing_when_the_lock_fails() -> None:
    driver = Driver(REFUSING)
    evaluation = drive(guard_tick(SHADOW, now=1030.0), driver.perform)
    assert (
        evaluation is not None and evaluation.decision.action is GuardAction.ROLL_BACK
    )
    roll_back = driver.effects[-1]
    assert isinstance(roll_back, RollBack)
    assert "refusal_rate" in [r.name for r in roll_back.report.tripped]
    driver = Driver(REFUSING, locks=False)
    assert drive(guard_tick(SHADOW, now=1030.0), driver.perform) is None
    assert isinstance(driver.effects[-1], LockRollout)


def test_guard_tick_of_a_manual_rollout_never_moves_it() -> None:
    manual = replace(CANARY, plan=None)
    driver = Driver()
    evaluation = drive(guard_tick(manual, now=10**6), driver.perform)
    assert evaluation is not None
    assert evaluation.decision.action is GuardAction.CONTINUE
    assert isinstance(driver.effects[-1], StayInStep)
    driver = Driver(REFUSING)
    drive(guard_tick(manual, now=10**6), driver.perform)
    assert isinstance(driver.effects[-1], RollBack)


def test_guard_tick_raises_a_quiet_pools_share_and_plans_the_next_step() -> None:
    """A canary at 10% of a pool of 1 request/s is too quiet to decide within
    the plan's ``max_step_s``: the step stays, at a larger share (RaiseShare);
    on a busy pool the next step begins at its own share."""
    from rollouts.domain.guard_tick import RaiseShare

    plan = parse_plan(
        {
            "steps": [
                {"stage": "canary", "percent": 10, **STEP},
                {"stage": "canary", "percent": 50, **STEP},
            ]
        }
    )
    quiet = replace(CANARY, step=0, plan=plan, percent=10.0, pool_rps=1.0)
    driver = Driver()
    evaluation = drive(guard_tick(quiet, now=1061.0), driver.perform)
    assert evaluation is not None
    raise_share = driver.effects[-1]
    assert isinstance(raise_share, RaiseShare), evaluation.decision.reason
    assert 10.0 < raise_share.percent <= plan.steps[1].percent
    assert evaluation.decision.percent == raise_share.percent
    assert "raising" in evaluation.decision.reason
    busy = replace(SHADOW, pool_rps=1000.0)
    driver = Driver()
    drive(guard_tick(busy, now=1061.0), driver.perform)
    advance = driver.effects[-1]
    assert isinstance(advance, AdvanceStep)
    assert advance.spec.percent == PLAN.steps[1].percent
