"""The failover drill on a recorded trace (``drills.domain.failover_trace``): each
conversation in one region, the traced teams' guarantees, the lost region's
arrivals reaching the survivor only after detection, and the target failing when
the survivor is too small for the shift."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import pytest

from drills.domain.failover_drill import run_failover_sim, small_scenario, with_trace
from drills.domain.failover_trace import (
    ShiftedArrivals,
    split_regions,
    trace_teams,
)
from drills.domain.fleet_config import FleetConfig
from drills.domain.replica import FleetRequest
from drills.domain.routing_ab import generate_arrivals
from drills.domain.workload import Arrival, ChatWorkload, TeamSpec

# Two interactive teams and a standard one, three turns a conversation.
TEAMS = (
    TeamSpec("chat", weight=0.5, tier="interactive"),
    TeamSpec("assist", weight=0.2, tier="interactive"),
    TeamSpec("api", weight=0.3, tier="standard"),
)


def arrivals(rate: float = 12.0, duration_s: float = 200.0) -> list[Arrival]:
    workload = ChatWorkload(
        arrival_rate=rate, message_interval_s=10.0, conversation_turns=3, teams=TEAMS
    )
    return generate_arrivals(workload, duration_s, seed=3)


def test_each_conversation_lives_in_one_region_about_half_each() -> None:
    trace = split_regions(arrivals(), seed=0)
    lost = {a.conversation for a in trace.lost}
    kept = {a.conversation for a in trace.survivor}
    assert lost and kept and not lost & kept
    assert trace.requests == len(arrivals())
    assert 0.35 < len(trace.lost) / trace.requests < 0.65
    # Seeded: the same split for the same seed, another for another.
    assert split_regions(arrivals(), seed=0) == trace
    assert {a.conversation for a in split_regions(arrivals(), seed=1).lost} != lost
    assert trace.span_s == arrivals()[-1].at
    assert trace.rps == pytest.approx(trace.requests / trace.span_s)


def test_traced_teams_are_guaranteed_their_share_with_headroom() -> None:
    traced = arrivals()
    teams = {team.name: team for team in trace_teams(traced)}
    assert set(teams) == {"chat", "assist", "api"}
    total = sum(a.prompt_tokens + a.max_tokens for a in traced)
    for name, team in teams.items():
        used = sum(a.prompt_tokens + a.max_tokens for a in traced if a.team == name)
        assert team.weight == pytest.approx(used / total)
        assert team.guaranteed_share == pytest.approx(1.25 * used / total)
    assert (teams["chat"].tier, teams["api"].tier) == ("interactive", "standard")
    # One team: its whole pool, never more.
    (alone,) = trace_teams([replace(a, team="x") for a in traced])
    assert alone.guaranteed_share == 1.0
    with pytest.raises(ValueError, match="no requests"):
        trace_teams([])
    with pytest.raises(ValueError, match="headroom"):
        trace_teams(traced, headroom=0.9)


def test_shifted_arrivals_come_at_their_own_times_from_detection_on() -> None:
    traced = [a for a in arrivals() if a.at < 60.0]
    shift = ShiftedArrivals(traced, start_at=30.0)
    sent: list[Arrival] = []

    def send(arrival: Arrival) -> FleetRequest:
        sent.append(arrival)
        return cast(FleetRequest, arrival)  # the source ignores what comes back

    later = [a for a in traced if a.at >= 30.0]
    now = shift.tick(0.0, send)
    assert now == later[0].at and not sent
    while now is not None:
        now = shift.tick(now, send)
    assert sent == later and shift.sent == len(later)


def test_the_window_fits_inside_the_trace() -> None:
    trace = split_regions(arrivals(duration_s=120.0), seed=0)
    s = with_trace(small_scenario(), trace)
    assert s.warmup_s + s.duration_s <= trace.span_s
    assert s.loss_at_s > 0 and s.loss_at_s + s.window_s < s.duration_s
    assert s.measured_tiers == ("interactive", "standard")
    # Every traced team is guaranteed its share, so all of them are inside.
    assert s.inside_teams() == {"chat", "assist", "api"}
    with pytest.raises(ValueError, match="must fit inside it"):
        replace(s, duration_s=trace.span_s)
    instant = split_regions([replace(arrivals()[0], at=0.0)], seed=0)
    with pytest.raises(ValueError, match="spans no time"):
        with_trace(small_scenario(), instant)


def test_the_lost_regions_conversations_reach_the_survivor_after_detection() -> None:
    trace = split_regions(arrivals(), seed=0)
    s = with_trace(small_scenario(), trace)
    report = run_failover_sim(FleetConfig(seed=1), s)
    assert report.passed, [c.detail for c in report.checks]
    assert report.failed_by_cause["sent_to_lost"] > 0
    shifted = report.scenario["chat_trace"]
    assert isinstance(shifted, dict)
    assert shifted["lost_region_requests"] == len(trace.lost)
    chat = report.pools[0]
    # Their history is in no cache of the survivor's: its hit rate falls.
    assert chat.hit_rate_before is not None and chat.hit_rate_shift is not None
    assert chat.hit_rate_shift < chat.hit_rate_before


def test_a_survivor_too_small_for_the_traced_shift_refuses_inside_teams() -> None:
    trace = split_regions(arrivals(rate=40.0), seed=0)
    tiny = with_trace(
        replace(
            small_scenario(), chat_replicas=1, reasoning_replicas=0, max_factor=1.0
        ),
        trace,
    )
    report = run_failover_sim(FleetConfig(seed=1), tiny)
    assert report.interactive_shed_inside > 0
    checks = {c.name: c.passed for c in report.checks}
    assert checks["survivor_sheds_no_interactive_inside_guarantee"] is False
