"""The batch scheduler's policy (``batches.domain.scheduler``): pure, no clock.

Escalation when the rate seen would miss the deadline, at risk when even the
standard tier cannot make it, expiry, the AIMD window and its pause, and no
verdict before the rate measures the pool rather than the job's own start.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from batches.domain.scheduler import (
    Escalation,
    JobPlan,
    JobView,
    Pace,
    SchedulerSettings,
    Throughput,
    after_answer,
    after_refusal,
    job_rate,
    plan_job,
)

SETTINGS = SchedulerSettings()  # window 4-64, judged after 30 + 60 s, safety 1.25
OBSERVED = SETTINGS.min_observed_s + SETTINGS.rate_window_s  # 90 s


# A job started at 0 with 1,000 lines of 500 tokens due at 10,000 s, seeing 100
# tokens/s with 10 lines in flight; its team may send 10,000 tokens/s.
JOB = JobView(
    remaining_lines=1000,
    in_flight=10,
    tokens_per_line=500.0,
    deadline_at=10_000.0,
    started_at=0.0,
    escalation=Escalation.BATCH,
    rate_tokens_s=100.0,
    standard_tokens_s=10_000.0,
    done_tokens=0,
)


def view(**changes: Any) -> JobView:
    return replace(JOB, **changes)


def plan(
    job: JobView, *, now: float, pace: Pace | None = None, escalate: bool = True
) -> JobPlan:
    return plan_job(
        job,
        pace or Pace(window=16),
        now=now,
        settings=replace(SETTINGS, escalate=escalate),
    )


# -- escalation --------------------------------------------------------------------


def test_a_rate_that_would_miss_the_deadline_raises_the_job_to_standard() -> None:
    # 500,000 tokens left at 100 tokens/s: 5,000 s, padded x1.25 = 6,250 s; from
    # 4,000 s that passes the 10,000 s deadline.
    decision = plan(view(), now=4000.0)
    assert decision.escalation is Escalation.STANDARD
    assert decision.projected_finish_at == pytest.approx(9000.0)
    assert decision.reason.startswith("raised to the standard tier")
    assert not decision.at_risk and not decision.expired


def test_a_rate_with_room_stays_on_idle_capacity() -> None:
    # 5,000 s x 1.25 from 3,000 s: 9,250 s, inside the deadline.
    decision = plan(view(), now=3000.0)
    assert decision.escalation is Escalation.BATCH
    assert "projected to finish" in decision.reason
    # The same job at a rate that only the padding makes late is raised.
    assert plan(view(), now=3800.0).escalation is Escalation.STANDARD


def test_a_job_ahead_of_its_schedule_is_judged_on_its_pace_so_far() -> None:
    # The morning rise: the last minute gave 100 tokens/s (late, as above), but the
    # job made 1,000,000 tokens in its first 4,000 s: 250 tokens/s. At that pace
    # its 500,000 tokens take 2,000 s, x1.25 from 4,000 s: 6,500 s, in time.
    ahead = view(done_tokens=1_000_000)
    assert job_rate(ahead, 4000.0) == pytest.approx(250.0)
    decision = plan(ahead, now=4000.0)
    assert decision.escalation is Escalation.BATCH
    assert decision.projected_finish_at == pytest.approx(6000.0)
    assert "250 tokens/s" in decision.reason
    # Idle-only it is not at risk either (the recent rate alone said 9,000 s).
    assert not plan(ahead, now=4000.0, escalate=False).at_risk
    # A job whose pace so far is slower than its recent rate: the recent rate.
    behind = view(done_tokens=40_000)  # 10 tokens/s
    assert job_rate(behind, 4000.0) == pytest.approx(100.0)
    assert plan(behind, now=4000.0).escalation is Escalation.STANDARD


def test_a_stalled_job_escalates_once_its_pace_so_far_falls_behind() -> None:
    # Nothing finished in the last minute; 300,000 tokens done since 0.
    stalled = view(rate_tokens_s=0.0, done_tokens=300_000)
    # At 2,000 s: 150 tokens/s, 500,000 tokens take 3,333 s x1.25: in time.
    assert plan(stalled, now=2000.0).escalation is Escalation.BATCH
    # At 4,000 s: 75 tokens/s, 6,667 s x1.25 from 4,000 s passes 10,000 s.
    assert plan(stalled, now=4000.0).escalation is Escalation.STANDARD
    # At risk once neither its rate nor the team's makes it (rule 4): at 75
    # tokens/s (more than the team's 50) it needs 6,667 s, and 6,000 s are left.
    capped = replace(stalled, standard_tokens_s=50.0)
    assert not plan(capped, now=2000.0).at_risk
    assert plan(capped, now=4000.0).at_risk


def test_escalation_is_kept_for_the_rest_of_the_job() -> None:
    fast = view(escalation=Escalation.STANDARD, rate_tokens_s=10_000.0)
    decision = plan(fast, now=100.0)
    assert decision.escalation is Escalation.STANDARD
    assert decision.reason.startswith("on the standard tier")


def test_idle_only_never_escalates_and_judges_risk_on_the_rate_seen() -> None:
    late = plan(view(), now=4000.0, escalate=False)
    assert late.escalation is Escalation.BATCH
    assert not late.at_risk  # 5,000 s left at the rate seen, 6,000 s to go
    hopeless = plan(view(), now=6000.0, escalate=False)
    assert hopeless.escalation is Escalation.BATCH
    assert hopeless.at_risk
    assert hopeless.reason.startswith("at risk: on idle capacity")
    # With escalation, the standard tier's 10,000 tokens/s would make it.
    assert not plan(view(), now=6000.0).at_risk


# -- no verdict on the job's own start ----------------------------------------------


def test_no_verdict_before_a_whole_rate_window_after_the_window_opened() -> None:
    # A job that just began sending: its rate is a fraction of what the pool
    # gives (its first answers take a line's length, its window opens from 4).
    ramping = view(rate_tokens_s=5.0, standard_tokens_s=1.0)
    for now in (SETTINGS.min_observed_s, OBSERVED - 1):
        decision = plan(ramping, now=now)
        assert decision.escalation is Escalation.BATCH
        assert not decision.at_risk
    judged = plan(ramping, now=OBSERVED)
    assert judged.escalation is Escalation.STANDARD
    assert judged.at_risk


def test_a_deadline_nearer_than_the_observation_is_judged_at_once() -> None:
    near = view(deadline_at=60.0, rate_tokens_s=None, standard_tokens_s=1.0)
    decision = plan(near, now=1.0)
    assert decision.escalation is Escalation.STANDARD
    assert decision.at_risk
    assert decision.projected_finish_at is None
    assert "finishes never" not in decision.reason  # the standard tier has a rate


# -- at risk ---------------------------------------------------------------------------


def test_at_risk_when_even_the_standard_tier_cannot_finish() -> None:
    # 500,000 tokens at the team's 50 tokens/s need 10,000 s; 9,000 s are left.
    slow_team = view(rate_tokens_s=10.0, standard_tokens_s=50.0)
    decision = plan(slow_team, now=1000.0)
    assert decision.at_risk
    assert decision.escalation is Escalation.STANDARD
    assert decision.reason.startswith("at risk: even at the standard tier")
    assert "1000 s late" in decision.reason
    # With the team's limit twice as high it is raised but not at risk.
    assert not plan(replace(slow_team, standard_tokens_s=100.0), now=1000.0).at_risk


def test_at_risk_when_the_jobs_own_window_caps_the_standard_tier() -> None:
    # At the standard tier the team may send 10,000 tokens/s, but 64 lines in
    # flight at the rate seen per line (10 lines make 20 tokens/s) carry only 128
    # tokens/s: 3,906 s for 500,000 tokens against 3,000 s left.
    capped = view(escalation=Escalation.STANDARD, rate_tokens_s=20.0, in_flight=10)
    decision = plan(capped, now=7000.0)
    assert decision.at_risk
    # A job with room to open its window is not at risk.
    assert not plan(replace(capped, in_flight=1), now=7000.0).at_risk
    # At the batch tier its lines' rate counts their waits in the admission
    # queue, which the standard tier would not have: the team's limit is the bound.
    batch = plan(replace(capped, escalation=Escalation.BATCH), now=7000.0)
    assert batch.escalation is Escalation.STANDARD and not batch.at_risk


def test_at_risk_while_the_guard_holds_raised_jobs_back() -> None:
    # A job submitted into the peak: nothing finished yet, its team may send
    # 10,000 tokens/s, but the guard's back-off leaves a raised job none of its
    # window. Nothing can finish it, so it is at risk at its first verdict.
    held = view(rate_tokens_s=0.0, done_tokens=0, standard_share=0.0)
    decision = plan(held, now=OBSERVED)
    assert decision.at_risk and decision.reason.endswith("(no idle capacity seen yet)")
    assert "finishes never" in decision.reason
    # The same job with the guard's full window is raised, not at risk.
    assert not plan(replace(held, standard_share=1.0), now=OBSERVED).at_risk
    # A tenth of the window: the team's 1,000 tokens/s need 500 s; 9,910 are left.
    assert not plan(replace(held, standard_share=0.1), now=OBSERVED).at_risk
    # A job with a measured rate of its own is judged on it, guard or not.
    going = replace(held, rate_tokens_s=100.0)
    assert not plan(going, now=OBSERVED).at_risk


def test_a_finished_job_sends_nothing_and_is_not_at_risk() -> None:
    decision = plan(view(remaining_lines=0, in_flight=0), now=20_000.0)
    assert decision.send == 0 and not decision.at_risk and not decision.expired


def test_the_deadline_expires_a_job_with_lines_left() -> None:
    decision = plan(view(remaining_lines=3), now=10_000.0)
    assert decision.expired and decision.at_risk
    assert decision.send == 0
    assert decision.reason == "deadline passed with 3 lines unfinished"


# -- pacing: the AIMD window and its pause --------------------------------------------


def test_the_window_grows_by_one_per_answer_up_to_its_max() -> None:
    settings = replace(SETTINGS, initial_window=2, max_window=4)
    pace = Pace.start(settings)
    windows = []
    for _ in range(4):
        pace = after_answer(pace, settings)
        windows.append(pace.window)
    assert windows == [3, 4, 4, 4]


def test_a_refusal_halves_the_window_and_pauses_for_the_retry_after() -> None:
    pace = after_refusal(
        Pace(window=16), now=100.0, retry_after_s=5.0, settings=SETTINGS
    )
    assert pace == Pace(window=8, paused_until=105.0)
    # Without a Retry-After the default pause; the window never goes under 1.
    pace = after_refusal(
        Pace(window=1), now=100.0, retry_after_s=None, settings=SETTINGS
    )
    assert pace == Pace(window=1, paused_until=100.0 + SETTINGS.default_pause_s)
    # A later, shorter pause does not cut an earlier, longer one.
    longer = after_refusal(
        Pace(window=8, paused_until=130.0),
        now=101.0,
        retry_after_s=2.0,
        settings=SETTINGS,
    )
    assert longer.paused_until == 130.0


def test_a_paused_job_sends_nothing_until_the_pause_ends() -> None:
    pace = Pace(window=8, paused_until=50.0)
    job = view(in_flight=2)
    paused = plan(job, now=49.0, pace=pace)
    assert paused.send == 0
    assert "paused 1 s" in paused.reason
    assert plan(job, now=50.0, pace=pace).send == 6  # the window minus in flight


def test_the_window_is_filled_but_never_past_the_lines_left() -> None:
    assert plan(view(in_flight=3), now=10.0, pace=Pace(window=10)).send == 7
    assert plan(view(remaining_lines=5, in_flight=3), now=10.0).send == 2
    assert plan(view(in_flight=20), now=10.0, pace=Pace(window=10)).send == 0


# -- the rate ----------------------------------------------------------------------------


def test_throughput_is_the_tokens_finished_over_its_window() -> None:
    throughput = Throughput(window_s=60.0)
    assert throughput.rate(0.0) is None
    throughput.start(0.0)
    assert throughput.rate(0.0) is None  # no time has passed
    throughput.add(10.0, 600)
    assert throughput.rate(30.0) == pytest.approx(20.0)  # since the start, 30 s
    throughput.add(70.0, 1200)
    # At 100 s the window is 40-100 s: the first answer has left it.
    assert throughput.rate(100.0) == pytest.approx(20.0)
    assert throughput.rate(200.0) == pytest.approx(0.0)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="initial_window"):
        SchedulerSettings(initial_window=0)
    with pytest.raises(ValueError, match="initial_window"):
        SchedulerSettings(initial_window=8, max_window=4)
    with pytest.raises(ValueError, match="safety"):
        SchedulerSettings(safety=0.9)
    with pytest.raises(ValueError, match="rate_window_s"):
        SchedulerSettings(rate_window_s=0)
