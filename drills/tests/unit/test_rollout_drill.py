"""The rollout drill at small scale: 100 streams (10 requests/s on 2 replicas), a
short plan of 60 s steps; the rollout's own split, memory, guards and plan decide."""

from __future__ import annotations

from dataclasses import replace
from functools import reduce

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drills.domain import rollout_drill
from drills.domain.capacity_plan import Scenario as CapacityScenario
from drills.domain.fleet_config import FleetConfig
from drills.domain.planned_fleet import at_region_peak, fleet_size
from drills.domain.rollout_drill import (
    REFUSAL_TOKENS,
    SCENARIO_NAMES,
    SCENARIOS,
    FigureBucket,
    RolloutDrillSettings,
    ScenarioOutcome,
    Traffic,
    replay_rollout,
    run_drill,
    simulate_traffic,
)
from metering.domain.figures import ERROR_KINDS, VersionFigures, one_request
from rollouts.domain.plan import Stage, parse_plan

SHORT_PLAN = parse_plan(
    {
        "steps": [
            {
                "stage": stage,
                "percent": percent,
                "min_duration_s": 60,
                "min_requests": 20,
                "min_conversations": 5,
            }
            for stage, percent in (("shadow", 25), ("canary", 10), ("canary", 50))
        ]
    }
)
SMALL = RolloutDrillSettings(
    # Enough for a 30% slower p95 to be told from noise within a step's minute.
    streams=200,
    plan=SHORT_PLAN,
    window_s=300.0,
    warmup_s=60.0,
    lead_s=150.0,
    after_s=120.0,
    # The sequential guards hold a step until they can say not worse: at 200
    # streams the good version needs about 19 minutes, the slow one 17.
    hold_allowance_s=1500.0,
    seed=1,
)


@pytest.fixture(scope="module")
def traffic() -> Traffic:
    return simulate_traffic(FleetConfig(seed=SMALL.seed), SMALL)


@pytest.fixture(scope="module")
def outcomes(traffic: Traffic) -> dict[str, ScenarioOutcome]:
    return {
        name: replay_rollout(traffic, SCENARIOS[name], SMALL) for name in SCENARIO_NAMES
    }


def _arrivals_between(traffic: Traffic, start: float, end: float) -> int:
    """Requests arriving in [start, end) seconds from the rollout's start."""
    lead = SMALL.lead_s
    return sum(1 for t in traffic.replay(lead + end) if t.at >= lead + start)


def _new_conversations_between(traffic: Traffic, start: float, end: float) -> int:
    """Conversations whose first turn arrived in [start, end) seconds from the
    rollout's start (only those may go to a canary)."""
    lead = SMALL.lead_s
    return sum(
        1 for t in traffic.replay(lead + end) if t.at >= lead + start and t.first_turn
    )


# -- the figures ---------------------------------------------------------------------

_request = st.fixed_dictionaries(
    {
        "ttft_s": st.none() | st.floats(0.0, 200.0),
        "answer": st.none() | st.integers(0, 200_000),
        "error_kind": st.sampled_from(ERROR_KINDS),
        "refused": st.booleans(),
    }
)


@given(st.lists(_request, max_size=40))
def test_figure_bucket_equals_summed_one_request(requests: list[dict]) -> None:
    bucket = FigureBucket()
    summed = []
    for r in requests:
        # An answer is no error; a request without an answer failed somehow.
        answer, kind = r["answer"], None if r["answer"] is not None else r["error_kind"]
        bucket.add(
            ttft_s=r["ttft_s"],
            output_tokens=answer,
            error_kind=kind,
            refused=r["refused"],
            conversation="conv:1",
        )
        summed.append(
            one_request(
                ttft_s=r["ttft_s"],
                output_tokens=answer,
                error_kind=kind,
                refused=r["refused"],
            )
        )
    expected = reduce(lambda a, b: a + b, summed, VersionFigures())
    assert replace(bucket.figures(), conversations=0) == expected
    assert bucket.figures().conversations == (1 if requests else 0)


# -- the traffic ---------------------------------------------------------------------


def test_traffic_is_the_seed_scaled_to_the_streams(traffic: Traffic) -> None:
    assert traffic.arrival_rate == pytest.approx(20.0)  # 200 x 30 tokens/s / 300
    # The capacity plan's fleet for one region at 20 requests/s.
    planned = fleet_size(at_region_peak(CapacityScenario(), 20.0)).replicas
    assert traffic.replicas == planned == 3
    rate = len(traffic.turns) / traffic.window_s
    assert 16.0 < rate < 24.0
    assert all(t.outcome == "ok" for t in traffic.turns)  # the plan's fleet carries it
    assert [t.at for t in traffic.turns] == sorted(t.at for t in traffic.turns)


def test_replay_cycles_shift_times_and_offset_conversations(traffic: Traffic) -> None:
    window, n = traffic.window_s, len(traffic.turns)
    replayed = list(traffic.replay(2.5 * window))
    assert traffic.cycles_used(2.5 * window) == 3
    assert replayed[:n] == list(traffic.turns)
    for first, again in zip(traffic.turns, replayed[n : 2 * n], strict=True):
        assert again.at == pytest.approx(first.at + window)
        assert first.finished_at is not None and again.finished_at is not None
        assert again.finished_at == pytest.approx(first.finished_at + window)
        assert again.conversation == first.conversation + traffic.stride
        assert again.output_tokens == first.output_tokens
    # A cycle's conversations are new ones, and the replay stops where asked.
    assert not {t.conversation for t in replayed[:n]} & {
        t.conversation for t in replayed[n : 2 * n]
    }
    assert max(t.at for t in replayed) < 2.5 * window <= max(t.at for t in replayed) + 1


# -- the scenarios ---------------------------------------------------------------------


def test_bad_version_is_rolled_back_at_its_first_canary_step(
    traffic: Traffic, outcomes: dict[str, ScenarioOutcome]
) -> None:
    bad = outcomes["bad"]
    assert bad.plan.steps[0].stage is Stage.CANARY  # no shadow first
    assert bad.decision == "rolled_back"
    assert (bad.step, bad.stage, bad.percent) == (0, "canary", 10.0)
    assert {"output_length", "refusal_rate"} <= set(bad.tripped_names)
    assert "error_rate" not in bad.tripped_names
    refusals = bad.tripped[bad.tripped_names.index("refusal_rate")]
    assert refusals.candidate == 1.0 and refusals.live == 0.0
    length = bad.tripped[bad.tripped_names.index("output_length")]
    assert length.candidate == REFUSAL_TOKENS
    # Caught within two guard periods of the canary's first request...
    assert bad.detection_s is not None
    assert 0 < bad.detection_s <= 2 * SMALL.guard_period_s
    # ...having reached some conversations: about the canary's share of those
    # that began meanwhile (only new ones go to it), and none after the rollback.
    assert bad.decided_at_s is not None
    came = _arrivals_between(traffic, 0.0, bad.decided_at_s)
    began = _new_conversations_between(traffic, 0.0, bad.decided_at_s)
    assert 0 < bad.conversations_saw <= bad.requests_saw <= 0.2 * came
    assert 0.05 * began <= bad.conversations_saw <= 0.2 * began


def test_bad_version_with_the_whole_plan_is_caught_by_its_shadow(
    outcomes: dict[str, ScenarioOutcome],
) -> None:
    shadowed = outcomes["bad_shadow"]
    assert shadowed.decision == "rolled_back" and shadowed.stage == "shadow"
    assert {"output_length", "refusal_rate"} <= set(shadowed.tripped_names)
    assert shadowed.shadow_copies > 0
    assert shadowed.conversations_saw == shadowed.requests_saw == 0


def test_good_version_goes_from_shadow_to_live_with_no_trip(
    outcomes: dict[str, ScenarioOutcome],
) -> None:
    good = outcomes["good"]
    assert good.decision == "promoted"
    assert [label for _, label in good.steps] == [s.label for s in SHORT_PLAN.steps]
    assert all(not tick.report.tripped for tick in good.ticks)
    assert good.tripped == ()
    # Each step advanced once every guard said not worse: after its minimums,
    # holding (never rolling back) while the evidence gathered.
    assert good.promotion_s is not None and good.promotion_s > SMALL.plan_s
    assert [t.action for t in good.ticks].count("advance") == len(SHORT_PLAN.steps)
    assert {tick.action for tick in good.ticks} <= {"advance", "continue", "hold"}
    assert good.conversations_saw > 0 and good.moves.rollback == 0


def test_slow_version_trips_the_ttft_guard_alone(
    outcomes: dict[str, ScenarioOutcome],
) -> None:
    """The sequential p95 guard reads only the tail past live's p95 x 1.2: here
    5.2% of the slow version's TTFTs, against 5%, so at 200 streams it holds the
    version in its shadow step (no user sees it) rather than rolling it back
    within the allowance. It is never promoted; if it is rolled back, the TTFT
    guard alone did it."""
    slow = outcomes["slow"]
    assert slow.decision in ("rolled_back", "pending")
    assert slow.steps[-1][1].startswith("shadow")
    if slow.decision == "pending":
        assert "p95 TTFT" in slow.reason and "undecided" in slow.reason
        return
    assert "p95_ttft" in slow.tripped_names
    assert "refusal_rate" not in slow.tripped_names
    assert "output_length" not in slow.tripped_names
    ttft = slow.tripped[slow.tripped_names.index("p95_ttft")]
    assert (
        ttft.change is not None and ttft.change > SHORT_PLAN.thresholds.p95_ttft_ratio
    )


def test_no_conversation_changes_version_mid_chat_but_at_a_rollback(
    outcomes: dict[str, ScenarioOutcome],
) -> None:
    for outcome in outcomes.values():
        assert outcome.moves.other == 0, outcome.name
    assert outcomes["bad"].moves.rollback > 0  # its canary conversations came back
    assert outcomes["bad_shadow"].moves.rollback == 0  # a shadow moves no one


def test_no_conversation_moves_when_the_first_canary_step_begins(
    outcomes: dict[str, ScenarioOutcome],
) -> None:
    assert all(o.moves.before_memory == 0 for o in outcomes.values())


def test_the_move_count_sees_moves_when_nothing_remembers(
    traffic: Traffic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A negative control: without the conversation memory, raising the canary's
    share moves conversations under way (so the zero above means something)."""
    monkeypatch.setattr(rollout_drill, "needs_memory", lambda record: False)
    good = replay_rollout(traffic, SCENARIOS["good"], SMALL)
    assert good.moves.other > 0


def test_run_drill_judges_the_targets(traffic: Traffic) -> None:
    outcome = run_drill(
        FleetConfig(), SMALL, scenarios=("bad", "good"), traffic=traffic
    )
    assert [s.name for s in outcome.scenarios] == ["bad", "good"]
    checks = {check.name: check for check in outcome.checks}
    assert set(checks) == {
        "bad_rolled_back_at_first_canary_within_two_periods",
        "good_promoted_without_trip",
        "no_mid_chat_change",
    }
    assert checks["bad_rolled_back_at_first_canary_within_two_periods"].passed
    assert checks["good_promoted_without_trip"].passed
    assert outcome.passed == all(c.passed for c in outcome.checks)
    with pytest.raises(ValueError, match="scenarios are"):
        run_drill(FleetConfig(), SMALL, scenarios=("worse",), traffic=traffic)
