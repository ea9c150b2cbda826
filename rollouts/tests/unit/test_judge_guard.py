"""The live-answer judge's guard: a win rate against its floor, sequentially."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metering.domain.figures import VersionFigures, one_judgement, one_request
from rollouts.domain import plan, sequential
from rollouts.domain.guard_tick import GuardedRollout, LockRollout, RollBack, guard_tick
from rollouts.domain.guards import (
    JUDGE_GUARD,
    GuardResult,
    GuardThresholds,
    JudgeCheck,
    PlanError,
    Verdict,
    compare,
    judge_interval,
)
from rollouts.domain.plan import (
    GuardAction,
    JudgeSpec,
    PlanState,
    RolloutPlan,
    Stage,
    decide_step,
    parse_plan,
)

GUARDS = GuardThresholds()
FLOOR = JudgeCheck(min_win_rate=0.45)


def judged(
    win: int = 0, loss: int = 0, tie: int = 0, unreadable: int = 0
) -> VersionFigures:
    return VersionFigures(
        judged={
            k: v
            for k, v in {
                "win": win,
                "loss": loss,
                "tie": tie,
                "unreadable": unreadable,
            }.items()
            if v
        }
    )


def requests(n: int) -> VersionFigures:
    """``n`` identical good answers: every other guard says not worse."""
    one = one_request(ttft_s=0.3, output_tokens=200)
    return VersionFigures(
        requests=n,
        answered=n,
        output_tokens=200 * n,
        ttft={k: v * n for k, v in one.ttft.items()},
        output={k: v * n for k, v in one.output.items()},
    )


def judge_result(figures: VersionFigures, check: JudgeCheck = FLOOR) -> GuardResult:
    report = compare(figures, requests(5000), GUARDS, check)
    return report.result(JUDGE_GUARD)


def test_without_a_judge_there_is_no_judge_guard() -> None:
    report = compare(requests(100), requests(100), GUARDS)
    with pytest.raises(KeyError):
        report.result(JUDGE_GUARD)


def test_equal_versions_are_not_worse_once_enough_pairs_are_judged() -> None:
    # Mostly ties, wins and losses alike: a win rate of one half.
    few = judge_result(judged(win=2, loss=2, tie=10) + requests(0))
    assert few.verdict is Verdict.TOO_FEW
    many = judge_result(judged(win=60, loss=60, tie=600))
    assert many.verdict is Verdict.NOT_WORSE, many.reason
    assert many.candidate == pytest.approx(0.5)
    assert many.lower is not None and many.lower >= 0.45


def test_a_candidate_that_loses_clearly_is_worse() -> None:
    result = judge_result(judged(win=5, loss=120, tie=300))
    assert result.verdict is Verdict.WORSE, result.reason
    assert result.upper is not None and result.upper < 0.45
    assert "worse than the floor" in result.reason


def test_a_few_pairs_all_lost_are_worse_before_the_minimum() -> None:
    # As with refusals: ten losses in ten pairs need not wait for twenty.
    result = judge_result(judged(loss=12))
    assert result.verdict is Verdict.WORSE, result.reason


def test_near_the_floor_it_is_undecided_with_an_estimate() -> None:
    result = judge_result(judged(win=40, loss=52, tie=300))
    assert result.verdict is Verdict.UNDECIDED, result.reason
    assert result.samples_needed is not None and result.samples_needed > 392


def test_unreadable_replies_count_for_neither_side() -> None:
    plain = judge_result(judged(win=60, loss=60, tie=600))
    noisy = judge_result(judged(win=60, loss=60, tie=600, unreadable=500))
    assert noisy.candidate == plain.candidate
    assert noisy.candidate_samples == plain.candidate_samples == 720
    assert "500 unreadable" in noisy.reason


def test_an_untrusted_judge_is_off_and_does_not_gate() -> None:
    untrusted = JudgeCheck(0.45, trusted=False, agreement="kappa 0.30, below 0.60")
    lost = judge_result(judged(loss=300), untrusted)
    assert lost.verdict is Verdict.OFF
    assert "kappa 0.30" in lost.reason
    report = compare(
        requests(5000) + judged(loss=300), requests(5000), GUARDS, untrusted
    )
    assert not report.tripped and not report.undecided
    # With trust, the same figures roll back.
    trusted = compare(requests(5000) + judged(loss=300), requests(5000), GUARDS, FLOOR)
    assert [r.name for r in trusted.tripped] == [JUDGE_GUARD]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 400), st.integers(0, 400), st.integers(0, 400))
def test_the_interval_holds_the_estimate_and_the_verdict_follows_it(
    win: int, loss: int, tie: int
) -> None:
    result = judge_result(judged(win, loss, tie))
    n = win + loss + tie
    assert result.candidate_samples == n
    if n == 0:
        assert result.verdict is Verdict.TOO_FEW
        return
    assert result.lower is not None and result.upper is not None
    assert result.candidate is not None
    assert result.lower <= result.candidate <= result.upper
    if result.verdict is Verdict.WORSE:
        assert result.upper < 0.45
    if result.verdict is Verdict.NOT_WORSE:
        assert result.lower >= 0.45


def test_equal_versions_are_rarely_called_worse_when_looked_at_every_period() -> None:
    """Anytime validity: 200 equal-version runs, looked at after every 100 pairs
    up to 4,000, trip far below alpha's share (1%) plus noise."""
    rng = np.random.default_rng(7)
    floor = 0.499  # equal versions sit just above it: the hardest case
    scales = sequential.rate_scales(0.5 - floor)
    tripped = 0
    for _ in range(200):
        counts = {"win": 0, "loss": 0, "tie": 0}
        for _look in range(40):
            draws = rng.multinomial(100, [0.1, 0.1, 0.8])
            for key, drawn in zip(counts, draws, strict=True):
                counts[key] += int(drawn)
            _, _, interval, _ = judge_interval(counts, alpha=0.01, scales=scales)
            if interval.upper < floor:
                tripped += 1
                break
    assert tripped <= 6  # 1% of 200 is 2; 6 is far past chance's reach


def test_plans_read_and_write_their_judge() -> None:
    parsed = parse_plan(
        {
            "judge": {
                "model": "reason-70b",
                "share": 0.5,
                "per_minute": 30,
                "min_win_rate": 0.4,
            }
        }
    )
    assert parsed.judge == JudgeSpec("reason-70b", 0.5, 30, 0.4)
    assert parse_plan(parsed.to_json()) == parsed
    assert parse_plan({}).judge is None
    assert parse_plan({"judge": None}).judge is None


@pytest.mark.parametrize(
    ("judge", "param"),
    [
        ({}, "judge.model"),
        ({"model": "m", "share": 0}, "judge.share"),
        ({"model": "m", "share": 1.5}, "judge.share"),
        ({"model": "m", "per_minute": 0}, "judge.per_minute"),
        ({"model": "m", "per_minute": True}, "judge.per_minute"),
        ({"model": "m", "min_win_rate": 0.5}, "judge.min_win_rate"),
        ({"model": "m", "colour": "red"}, "judge.colour"),
        ("reason-70b", "judge"),
    ],
)
def test_a_bad_judge_is_refused_with_its_param(judge: object, param: str) -> None:
    with pytest.raises(PlanError) as caught:
        parse_plan({"judge": judge})
    assert param in [p for p, _ in caught.value.problems]


def test_an_undecided_judge_holds_the_step_and_a_tick_rolls_back_on_it() -> None:
    spec = plan.StepSpec(Stage.CANARY, 10.0, 0.0, 0, 0)
    the_plan = RolloutPlan(steps=(spec,), judge=JudgeSpec("judge-m"))
    state = PlanState(step=0, step_started_at=0.0)
    undecided = compare(
        requests(5000) + judged(win=40, loss=52, tie=300),
        requests(5000),
        GUARDS,
        FLOOR,
    )
    held = decide_step(
        the_plan, state, undecided, now=600.0, requests=5000, conversations=900
    )
    assert held.action is GuardAction.HOLD
    assert JUDGE_GUARD in held.reason or "judge win rate" in held.reason

    rollout = GuardedRollout(
        model="m",
        candidate="v2",
        live="v1",
        stage=Stage.CANARY,
        percent=10.0,
        step=0,
        step_started_at=0.0,
        plan=the_plan,
    )
    steps = guard_tick(rollout, now=600.0)
    effect = steps.send(None)
    effect = steps.send(requests(5000) + judged(win=5, loss=200, tie=300))
    effect = steps.send(requests(5000))  # baseline
    assert isinstance(effect, LockRollout)
    effect = steps.send(True)
    effect = steps.send(None)  # recorded
    assert isinstance(effect, RollBack)
    assert JUDGE_GUARD in effect.reason


def test_one_judgement_counts_no_request() -> None:
    figures = one_judgement("loss") + one_judgement("win")
    assert figures.requests == 0 and figures.judged == {"loss": 1, "win": 1}
    assert VersionFigures.from_fields(figures.to_fields()) == figures
    with pytest.raises(ValueError, match="unknown judge outcome"):
        one_judgement("draw")
