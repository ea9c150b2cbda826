"""The fleet experiments on small fleets: isolation, overload order, capacity."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from drills.domain.capacity_test import (
    CapacityAnswer,
    CapacityCriteria,
    run_capacity_test,
    step_rates,
)
from drills.domain.fleet_config import FleetConfig
from drills.domain.isolation_sim import (
    NOISY_TEAM,
    IsolationScenario,
    run_isolation_sim,
    team_arrivals,
)
from drills.domain.overload import (
    OverloadOutcome,
    OverloadScenario,
    planned_capacity_rps,
    run_overload,
)
from drills.domain.timeline import (
    bin_starts,
    count_in_bins,
    max_in_bins,
    percentile_in_bins,
)
from drills.domain.workload import Arrival, ChatWorkload, TeamSpec

CALIBRATION = ChatWorkload(
    prompt_tokens=650, history_tokens=0, answer_tokens=250, max_tokens=250
)


def small_fleet(**overrides: Any) -> FleetConfig:
    values: dict[str, Any] = {
        "replicas": 2,
        "admission": True,
        "batch_ceiling": 0.9,
        "seed": 0,
    }
    return FleetConfig(**{**values, **overrides})


def small_isolation(**overrides: Any) -> IsolationScenario:
    values: dict[str, Any] = {
        "teams": 3,
        "workload": ChatWorkload(arrival_rate=6.0),
        "duration_s": 180.0,
        "warmup_s": 30.0,
    }
    return IsolationScenario(**{**values, **overrides})


# -- timeline ----------------------------------------------------------------------------


def test_bins_cut_the_window_and_ignore_points_outside_it() -> None:
    assert bin_starts(10.0, 35.0, 10.0) == [10.0, 20.0, 30.0]
    assert count_in_bins([9.9, 10.0, 19.9, 34.9, 35.0], 10.0, 35.0, 10.0) == [2, 0, 1]
    points = [(10.0, 1.0), (11.0, 5.0), (31.0, 2.0)]
    assert max_in_bins(points, 10.0, 35.0, 10.0) == [5.0, None, 2.0]
    assert percentile_in_bins(points, 10.0, 35.0, 10.0, 0.5) == [1.0, None, 2.0]


# -- isolation ---------------------------------------------------------------------------


def test_team_arrivals_of_one_team_do_not_depend_on_another_teams_rate() -> None:
    workload = ChatWorkload(
        arrival_rate=4.0, teams=(TeamSpec("quiet"), TeamSpec("loud"))
    )

    def quiet(loud_rate: float) -> list[Arrival]:
        arrivals = team_arrivals(
            workload,
            {"quiet": [(0.0, 2.0)], "loud": [(0.0, loud_rate)]},
            60.0,
            seed=3,
        )
        return [a for a in arrivals if a.team == "quiet"]

    assert quiet(2.0) == quiet(20.0)
    times = [a.at for a in team_arrivals(workload, {"loud": [(0.0, 5.0)]}, 60, seed=3)]
    assert times == sorted(times) and len(times) > 200


def test_isolation_holds_on_a_small_fleet_with_limits() -> None:
    outcome = run_isolation_sim(small_fleet(), small_isolation())
    assert outcome.verdict.passed, outcome.verdict.reasons
    noisy = next(row for row in outcome.rows if row.team == NOISY_TEAM)
    # Ten times its limit: about nine requests in ten are refused.
    assert noisy.rate_limited_noisy > 0.8 * noisy.requests_noisy
    assert noisy.offered_tokens_per_minute_noisy > 8 * noisy.tokens_per_minute
    for row in outcome.rows:
        if not row.is_noisy:
            assert row.rate_limited_noisy == row.rate_limited_baseline == 0
            assert row.p95_change is not None and abs(row.p95_change) <= 0.10


def test_isolation_fails_without_limits() -> None:
    outcome = run_isolation_sim(small_fleet(), small_isolation(has_limits=False))
    assert not outcome.verdict.passed
    quiet = [row for row in outcome.rows if not row.is_noisy]
    assert all(row.tokens_per_minute == 0 for row in outcome.rows)
    assert all(row.p95_change is not None and row.p95_change > 0.5 for row in quiet)


def test_isolation_is_deterministic_for_a_seed() -> None:
    first = run_isolation_sim(small_fleet(), small_isolation(duration_s=60.0))
    again = run_isolation_sim(small_fleet(), small_isolation(duration_s=60.0))
    assert first.rows == again.rows


# -- overload ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def overload() -> OverloadOutcome:
    scenario = OverloadScenario(
        capacity_rps=planned_capacity_rps(2, 2500, 300),
        step_s=60.0,
        warmup_s=30.0,
    )
    return run_overload(small_fleet(), scenario)


def test_overload_keeps_the_seeds_order_on_a_small_fleet(
    overload: OverloadOutcome,
) -> None:
    assert {c.name: c.passed for c in overload.checks} == {
        "batch_pauses_first": True,
        "over_share_429_before_standard_queues": True,
        "standard_shed_after_batch": True,
        "interactive_inside_guarantee_never_shed": True,
    }


def test_overload_sheds_batch_and_refuses_only_over_share_paid_teams(
    overload: OverloadOutcome,
) -> None:
    tiers = {row.name: row for row in overload.tiers}
    teams = {row.name: row for row in overload.teams}
    assert tiers["batch"].shed > 0 and tiers["batch"].rate_limited == 0
    assert tiers["interactive"].shed == tiers["standard"].shed == 0
    assert teams["chat"].rate_limited == teams["chat"].shed == 0
    assert teams["assist"].rate_limited > 0 and teams["reports"].rate_limited > 0
    # Below capacity paid traffic is hardly ever refused (two replicas are bursty).
    first = [s for s in overload.steps if s.step == 1 and s.tier != "batch"]
    last = [s for s in overload.steps if s.step == 4 and s.tier != "batch"]
    refused_first = sum(s.rate_limited + s.shed for s in first)
    refused_last = sum(s.rate_limited + s.shed for s in last)
    assert refused_first < 0.1 * refused_last


def test_overload_bins_cover_the_window_per_tier(overload: OverloadOutcome) -> None:
    bins = overload.bins
    assert len(bins.starts_s) == 24  # 4 steps of 60 s in 10 s bins
    assert bins.factors[0] == 0.8 and bins.factors[-1] == 1.6
    for series in (bins.queued_max, bins.shed, bins.rate_limited, bins.ttft_p95_s):
        assert set(series) == {"interactive", "standard", "batch"}
        assert all(len(values) == 24 for values in series.values())
    assert sum(bins.shed["batch"]) == next(
        row.shed for row in overload.tiers if row.name == "batch"
    )


def test_overload_guarantee_check_fails_when_a_team_outgrows_its_share() -> None:
    # "chat" is sized exactly at its guarantee (0.25 x 1.6 = 0.40), but answers that
    # slow under load hold its tokens longer, so it passes its share and gets 429s.
    scenario = OverloadScenario(
        capacity_rps=planned_capacity_rps(2, 2500, 300),
        factors=(1.6,),
        step_s=60.0,
        warmup_s=20.0,
        workload=ChatWorkload(
            teams=(
                TeamSpec(
                    "chat", weight=0.25, tier="interactive", guaranteed_share=0.40
                ),
                TeamSpec("api", weight=0.75, tier="standard"),
            )
        ),
    )
    assert scenario.inside_guarantee_teams() == ("chat",)
    outcome = run_overload(small_fleet(), scenario)
    check = next(
        c for c in outcome.checks if c.name == "interactive_inside_guarantee_never_shed"
    )
    assert not check.passed and "chat" in check.detail
    assert not outcome.passed


# -- capacity ----------------------------------------------------------------------------


def short_capacity(workload: ChatWorkload, **overrides: Any) -> CapacityAnswer:
    rates = step_rates(
        start_tokens_per_s=500,
        step_tokens_per_s=250,
        max_tokens_per_s=4000,
        answer_tokens=workload.answer_tokens,
    )
    values: dict[str, Any] = {"duration_s": 60.0, "warmup_s": 15.0}
    return run_capacity_test(
        FleetConfig(replicas=1, seed=0), workload, rates, **{**values, **overrides}
    )


def test_step_rates_offer_even_steps_of_output_tokens() -> None:
    rates = step_rates(
        start_tokens_per_s=250,
        step_tokens_per_s=250,
        max_tokens_per_s=1000,
        answer_tokens=250,
    )
    assert rates == [1.0, 2.0, 3.0, 4.0]


def test_capacity_test_finds_about_2500_for_the_calibration_shape() -> None:
    answer = short_capacity(CALIBRATION)
    assert answer.tokens_per_s is not None
    assert 2000 <= answer.tokens_per_s <= 2900
    assert answer.strict_tokens_per_s is None or (
        answer.strict_tokens_per_s <= answer.tokens_per_s
    )
    held = [s for s in answer.steps if s.holds]
    assert held
    assert all(s.ttft_p95_s is not None and s.ttft_p95_s < 1.0 for s in held)
    # It stopped after two failing steps in a row.
    assert [s.holds for s in answer.steps[-2:]] == [False, False]


def test_capacity_goes_down_for_heavier_prompts() -> None:
    light = short_capacity(CALIBRATION)
    heavy = short_capacity(replace(CALIBRATION, prompt_tokens=2000))
    assert heavy.tokens_per_s is not None and light.tokens_per_s is not None
    assert heavy.tokens_per_s < 0.7 * light.tokens_per_s


def test_a_stricter_stream_rule_finds_less() -> None:
    median = short_capacity(CALIBRATION)
    strict = short_capacity(
        CALIBRATION, criteria=CapacityCriteria(stream_quantile=0.05)
    )
    assert strict.tokens_per_s is not None and median.tokens_per_s is not None
    assert strict.tokens_per_s <= median.tokens_per_s
