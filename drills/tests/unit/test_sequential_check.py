"""The rollout drill's sequential check: the issue's targets on a few seeds."""

from __future__ import annotations

import dataclasses

from drills.domain.judge_rates import judge_rates
from drills.domain.sequential_check import (
    POOLS,
    VERSIONS,
    Cell,
    SequentialOutcome,
    SequentialSettings,
    judge_sequential,
    run_one,
)

POOL = {p.name: p for p in POOLS}
VERSION = {v.name: v for v in VERSIONS}


def test_pools_are_the_issues_traffic() -> None:
    assert POOL["7b-100"].rps == 10.0
    assert POOL["7b-1000"].rps == 100.0
    assert POOL["70b-peak"].streams == 60 and POOL["70b-peak"].rps == 4.0


def test_a_version_refusing_everything_is_rolled_back_within_3_periods() -> None:
    settings = SequentialSettings(seeds=3, horizon_s=1800.0)
    for name in ("70b-peak", "7b-100"):
        for seed in range(3):
            run = run_one(POOL[name], VERSION["refuses"], settings, seed)
            assert run.decision == "rolled_back", (name, seed, run)
            assert run.periods_to_decision is not None
            assert run.periods_to_decision <= 3.0, (name, seed, run)


def test_a_good_version_is_promoted_and_a_worse_one_is_not() -> None:
    settings = SequentialSettings(seeds=1, horizon_s=2 * 3600.0)
    good = run_one(POOL["7b-1000"], VERSION["good"], settings, 1)
    assert good.decision == "promoted", good
    worse = run_one(POOL["7b-1000"], VERSION["worse"], settings, 1)
    assert worse.decision != "promoted", worse
    outcome = SequentialOutcome(
        settings,
        (
            Cell(POOL["7b-1000"], VERSION["good"], (good,)),
            Cell(POOL["7b-1000"], VERSION["worse"], (worse,)),
        ),
    )
    checks = {c.name: c.passed for c in judge_sequential(outcome)}
    assert checks == {
        "7b-1000_good_promoted_19_of_20": True,
        "7b-1000_worse_never_promoted": True,
    }


def test_a_subtly_worse_version_is_caught_by_the_judge_and_only_by_it() -> None:
    """Same errors, refusals, latency and lengths as live, worse answers: with
    the plan's judge it is rolled back by the judge guard; without a judge the
    same traffic promotes it (what the judge is for)."""
    settings = SequentialSettings(seeds=1, horizon_s=3 * 3600.0)
    caught = run_one(POOL["7b-1000"], VERSION["subtle"], settings, 2)
    assert caught.decision == "rolled_back", caught
    assert caught.tripped == ("judge_win_rate",), caught
    assert caught.judged_pairs > 0
    blind = dataclasses.replace(
        settings, plan=dataclasses.replace(settings.plan, judge=None)
    )
    missed = run_one(POOL["7b-1000"], VERSION["subtle"], blind, 2)
    assert missed.decision == "promoted", missed
    outcome = SequentialOutcome(
        settings, (Cell(POOL["7b-1000"], VERSION["subtle"], (caught,)),)
    )
    checks = {c.name: c.passed for c in judge_sequential(outcome)}
    assert checks == {"7b-1000_subtle_caught_by_judge_18_of_20": True}


def test_the_judges_rates_come_from_the_platforms_judge_code() -> None:
    equal = dict(judge_rates(0.95, 0.95, 1.0, pairs=600))
    worse = dict(judge_rates(0.75, 0.95, 1.0, pairs=600))
    noisy = dict(judge_rates(0.75, 0.95, 0.6, pairs=600))
    # A right judge: each side wins where only its answer is right.
    assert abs(equal["win"] - equal["loss"]) < 0.04
    assert worse["loss"] > worse["win"] + 0.12
    # A noisier judge blurs the difference towards no preference.
    assert worse["loss"] - worse["win"] > noisy["loss"] - noisy["win"] > 0
    assert abs(sum(equal.values()) - 1.0) < 1e-9
