"""The traffic twin's check: the day's load plan and the comparison's arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise

import pytest

from drills.domain.fleet import FleetSim
from drills.domain.fleet_config import FleetConfig, FleetEvent
from drills.domain.fleet_scaling import FleetAutoscaling
from drills.domain.twin_check import (
    ReplicaPoint,
    Served,
    TwinFigures,
    TwinLoad,
    compare,
    decode_s_per_token,
    figures_of,
    first_turn_hit_share,
    followed_fleet,
    paired_figures,
    plan_turns,
    probe_text,
    rate_at,
    replay,
    start_delay_s,
    system_text,
    twin_fleet_config,
)
from drills.domain.workload import Arrival, ChatWorkload, TeamSpec
from models_registry.domain.autoscaler import ScalingSettings


def served(at: float, ttft: float, prompt: int = 100, cached: int = 0) -> Served:
    return Served(
        at=at,
        ended_at=at + 1.0,
        ttft_s=ttft,
        prompt_tokens=prompt,
        cached_tokens=cached,
        max_tokens=20,
    )


def live_pool(tick_times: Sequence[float] = ()) -> FleetConfig:
    """The twin of a live pool of 1-3 replicas of 1,000 tokens, 2-s ticks and
    2-s starts."""
    return twin_fleet_config(
        FleetConfig(),
        settings=ScalingSettings(min_replicas=1, max_replicas=3),
        replica_tokens_in_flight=1000,
        profile="a100-8b",
        interval_s=2.0,
        start_s=2.0,
        seed=0,
        tick_times=tick_times,
    )


def figures(**changes: object) -> TwinFigures:
    values: dict[str, object] = {
        "requests": 100,
        "ttft_p50_s": 0.05,
        "ttft_p95_s": 0.10,
        "hit_rate": 0.50,
        "tokens_in_flight_mean": 1000.0,
        "replicas_mean": 1.5,
        "replicas_peak": 2,
        "desired_changes": 2,
    }
    values.update(changes)
    return TwinFigures(**values)  # type: ignore[arg-type]


def test_rate_rises_to_the_peak_at_mid_window_and_falls_back() -> None:
    load = TwinLoad(duration_s=100.0, peak_rps=4.0, trough_rps=1.0)
    assert rate_at(load, 0.0) == pytest.approx(1.0)
    assert rate_at(load, 50.0) == pytest.approx(4.0)
    assert rate_at(load, 100.0) == pytest.approx(1.0)
    assert rate_at(load, 25.0) < rate_at(load, 40.0)


def test_plan_is_deterministic_and_busier_at_mid_day() -> None:
    load = TwinLoad(seed=3, duration_s=300.0, peak_rps=4.0, trough_rps=0.5)
    turns = plan_turns(load)
    assert turns == plan_turns(load)
    assert turns != plan_turns(TwinLoad(seed=4, duration_s=300.0, peak_rps=4.0))
    middle = sum(1 for t in turns if 100 <= t.at < 200)
    ends = sum(1 for t in turns if t.at < 50 or t.at >= 250)
    assert middle > 2 * ends


def test_plan_conversations_take_turns_in_order_with_a_gap() -> None:
    load = TwinLoad(seed=1, duration_s=200.0, min_gap_s=2.0, max_turns=4)
    by: dict[str, list[float]] = {}
    for turn in plan_turns(load):
        assert turn.turn == len(by.setdefault(turn.conversation, []))
        by[turn.conversation].append(turn.at)
    assert max(len(ats) for ats in by.values()) > 1
    assert all(len(ats) <= 4 for ats in by.values())
    for ats in by.values():
        assert all(b - a >= 2.0 - 1e-3 for a, b in pairwise(ats))


def test_shared_system_prompts_are_shared_and_own_ones_are_not() -> None:
    load = TwinLoad(seed=2, duration_s=200.0, shared_system_share=0.5)
    turns = [t for t in plan_turns(load) if t.turn == 0]
    shared = [t for t in turns if t.system >= 0]
    own = [t for t in turns if t.system < 0]
    assert shared and own
    same = [t for t in shared if t.system == shared[0].system]
    assert len({system_text(load, t) for t in same}) == 1
    assert len({system_text(load, t) for t in own}) == len(own)


def test_figures_count_hits_tokens_in_flight_and_replicas() -> None:
    sides = [served(0.0, 0.1, prompt=100, cached=0), served(2.0, 0.3, 300, 150)]
    points = [ReplicaPoint(0.0, 1, 1), ReplicaPoint(4.0, 2, 2), ReplicaPoint(6.0, 1, 1)]
    got = figures_of(sides, points, window_s=10.0)
    assert got.requests == 2
    assert got.hit_rate == pytest.approx(150 / 400)
    # (100 + 20) x 1 s + (300 + 20) x 1 s over 10 s
    assert got.tokens_in_flight_mean == pytest.approx(44.0)
    assert got.request_s_mean == pytest.approx(1.0)  # each lasted 1 s
    # 1 replica for 4 s, 2 for 2 s, 1 for the last 4 s
    assert got.replicas_mean == pytest.approx(12 / 10)
    assert (got.replicas_peak, got.desired_changes) == (2, 2)
    assert got.ttft_p95_s == pytest.approx(0.3)


def test_figures_of_nothing_are_missing_not_zero() -> None:
    got = figures_of([], [], window_s=5.0)
    assert (got.requests, got.ttft_p95_s, got.hit_rate) == (0, None, None)
    assert got.tokens_in_flight_mean is None and got.replicas_mean is None
    assert got.request_s_mean is None


def test_compare_passes_within_tolerance_on_the_gated_figures() -> None:
    measured = figures()
    predicted = figures(ttft_p95_s=0.11, hit_rate=0.46, replicas_mean=3.0)
    result = compare(predicted, measured, tolerance=0.15)
    rows = {row.name: row for row in result.rows}
    assert rows["ttft_p95_s"].relative_error == pytest.approx(0.10)
    assert rows["hit_rate"].relative_error == pytest.approx(-0.08)
    # Reported, not gated: far off and the check still passes.
    assert rows["replicas_mean"].relative_error == pytest.approx(1.0)
    assert not rows["replicas_mean"].is_gated
    assert result.passed


@pytest.mark.parametrize(
    "predicted",
    [
        figures(ttft_p95_s=0.12),  # +20%
        figures(hit_rate=0.40),  # -20%
        figures(hit_rate=None),  # the twin saw no hits to count
        figures(requests=0),  # the twin served nothing
    ],
)
def test_compare_fails_when_a_gated_figure_is_off_or_missing(
    predicted: TwinFigures,
) -> None:
    assert not compare(predicted, figures(), tolerance=0.15).passed


def test_compare_fails_without_a_live_measurement() -> None:
    measured = figures(requests=0, ttft_p95_s=None, hit_rate=None)
    result = compare(figures(), measured)
    assert not result.passed
    assert all(r.relative_error is None for r in result.rows if r.is_gated)


def test_compare_refuses_unknown_gates_and_bad_tolerance() -> None:
    with pytest.raises(ValueError, match="no such figure"):
        compare(figures(), figures(), gated=["ttft_p96_s"])
    with pytest.raises(ValueError, match="tolerance"):
        compare(figures(), figures(), tolerance=0.0)


def test_start_delay_is_the_time_from_a_scale_up_to_serving() -> None:
    points = [
        ReplicaPoint(0.0, 1, 1),
        ReplicaPoint(1.0, 1, 2),
        ReplicaPoint(2.0, 1, 2),
        ReplicaPoint(4.0, 2, 2),
        ReplicaPoint(5.0, 2, 3),
        ReplicaPoint(7.0, 3, 3),
    ]
    assert start_delay_s(points) == pytest.approx(2.0)
    assert start_delay_s(points[:3]) is None


def test_twin_fleet_config_runs_the_live_pool() -> None:
    settings = ScalingSettings(min_replicas=1, max_replicas=3)
    config = twin_fleet_config(
        FleetConfig(policy="least_tokens"),
        settings=settings,
        replica_tokens_in_flight=1500,
        profile="a100-8b",
        interval_s=2.0,
        start_s=1.5,
        seed=4,
    )
    assert (config.replicas, config.block_size, config.policy) == (
        1,
        16,
        "least_tokens",
    )
    assert config.admission and config.seed == 4
    assert config.autoscaling is not None
    assert config.autoscaling.settings == settings
    assert config.autoscaling.cold_start.warm_s == pytest.approx(0.0)
    assert config.autoscaling.cold_start.cold_s == pytest.approx(1.5)


def test_first_turn_hits_are_the_shared_prefixes_of_a_trace() -> None:
    lines: list[dict[str, object]] = [
        {"conversation": "a", "prompt_tokens": 100, "cached_tokens": 0},
        {"conversation": "b", "prompt_tokens": 100, "cached_tokens": 48},
        {"conversation": "a", "prompt_tokens": 200, "cached_tokens": 96},
    ]
    assert first_turn_hit_share(lines) == pytest.approx(48 / 400)
    assert first_turn_hit_share([]) is None


def test_decode_per_token_is_the_median_after_the_first_token() -> None:
    """(ended - at - ttft) / (output - 1), median; answers of one token say
    nothing about decode."""

    def answer(ttft: float, ended: float, output: int) -> Served:
        return Served(
            at=10.0,
            ended_at=10.0 + ended,
            ttft_s=ttft,
            prompt_tokens=100,
            cached_tokens=0,
            max_tokens=64,
            output_tokens=output,
        )

    assert decode_s_per_token(
        [answer(0.1, 1.1, 101), answer(0.1, 0.6, 51), answer(0.2, 3.2, 101)]
    ) == pytest.approx(0.01)
    assert decode_s_per_token([answer(0.1, 0.1, 1), answer(0.1, 0.5, 0)]) is None


def test_followed_fleet_adds_replicas_where_the_live_pool_did() -> None:
    """GIVEN a live pool that served 1 replica, 2 from 40 s, 3 from 70 s, then
    drained one at 110 s, with replicas serving 2 s after they are asked for,
    and a trace whose clock starts 0.5 s after the live one
    THEN the followed fleet starts at 1 replica with no autoscaler, and asks for
    one replica at 37.5 s and one at 67.5 s (serving when the live ones did, on
    the trace's clock); the drain is not followed."""
    live = [
        ReplicaPoint(0.0, 1, 1),
        ReplicaPoint(38.0, 1, 2),
        ReplicaPoint(40.0, 2, 2),
        ReplicaPoint(70.0, 3, 3),
        ReplicaPoint(71.0, 3, 3),
        ReplicaPoint(110.0, 2, 2),
    ]
    base = live_pool()
    config, events = followed_fleet(base, live, start_s=2.0, shift_s=0.5)
    assert (config.replicas, config.autoscaling, config.cold_start_s) == (1, None, 2.0)
    assert config.admission and config.block_size == base.block_size
    assert [(e.kind, e.at, e.count) for e in events] == [
        ("add_replica", pytest.approx(37.5), 1),
        ("add_replica", pytest.approx(67.5), 1),
    ]


def test_the_followed_fleet_serves_from_the_live_times() -> None:
    """GIVEN a steady load on the followed fleet of one replica, one more asked
    for at 20 s with a 2 s start
    THEN the second replica serves from 22 s on."""
    config = FleetConfig(replicas=1, block_size=16, cold_start_s=2.0)
    events = [FleetEvent(20.0, "add_replica")]
    result = FleetSim(config, ChatWorkload(arrival_rate=1.0), events=events).run(40.0)
    serving = {round(s.at): s.replicas for s in result.samples}
    assert serving[21] == 1 and serving[23] == 2


def test_probe_text_starts_with_its_key_and_is_as_long_as_asked() -> None:
    text = probe_text("probe 3 direct", 8)
    assert text.startswith("probe 3 direct ")
    assert len(text.split()) == 3 + 8
    assert text == probe_text("probe 3 direct", 8)
    assert probe_text("probe 3 through", 8) != text


def test_replay_reports_its_autoscalers_changes_with_their_reasons() -> None:
    """GIVEN a pool of one replica of 1,000 tokens, autoscaled up to three, and
    four requests a second of 200 tokens for 30 s
    THEN its autoscaler grows it, and each change the replay reports says from,
    to, why, and the signals it saw; the followed fleet (no autoscaler) none."""
    config = live_pool()
    arrivals = [
        Arrival(
            at=i / 4,
            team="t",
            tier="standard",
            conversation=i,
            prompt_tokens=100,
            output_tokens=100,
            max_tokens=100,
            history_tokens=0,
            stream_tokens=0,
        )
        for i in range(120)
    ]
    teams = [TeamSpec("t", guaranteed_share=1.0)]
    _, points, changes = replay(arrivals, config, window_s=30.0, teams=teams)
    assert changes and changes[0]["from"] == 1 and changes[0]["to"] > 1
    assert max(p.desired for p in points) == max(c["to"] for c in changes)
    for change in changes:
        assert change["reason"] and change["queue_depth"] is not None
        assert change["tokens_in_flight"] is not None
    followed, _ = followed_fleet(config, [], start_s=2.0, shift_s=0.0)
    assert replay(arrivals, followed, window_s=30.0, teams=teams)[2] == []


def test_the_twins_autoscaler_ticks_when_the_live_one_did() -> None:
    """GIVEN the live ticks at 1.3, 3.35 and 5.4 s on the trace's clock (one
    before it, at -0.7 s, dropped)
    THEN the twin's policy is called at those times, and every 2 s after."""
    ticks = [-0.7, 1.3, 3.35, 5.4]
    config = live_pool(tick_times=ticks)
    assert config.autoscaling is not None
    assert config.autoscaling.tick_times == (1.3, 3.35, 5.4)
    result = FleetSim(config, ChatWorkload(arrival_rate=1.0)).run(10.0)
    assert result.scaling is not None
    called = [tick.decision.at for tick in result.scaling.ticks]
    assert called[:5] == pytest.approx([1.3, 3.35, 5.4, 7.4, 9.4])


@pytest.mark.parametrize("ticks", [(-1.0,), (2.0, 2.0), (3.0, 1.0)])
def test_tick_times_must_be_rising_and_not_negative(
    ticks: tuple[float, ...],
) -> None:
    with pytest.raises(ValueError, match="tick_times"):
        FleetAutoscaling(ScalingSettings(), tick_times=ticks)


def test_requests_line_up_through_the_trace_by_turn_and_arrival() -> None:
    """Live requests pair with replayed ones through their lines: the k-th turn
    of a conversation, then the line's arrival time; a live turn whose line has
    another prompt size (a record missing) pairs with nothing."""
    lines = [
        {"t": 0.0, "conversation": "a", "prompt_tokens": 100},
        {"t": 0.5, "conversation": "b", "prompt_tokens": 80},
        {"t": 2.0, "conversation": "a", "prompt_tokens": 300},
        {"t": 2.5, "conversation": "b", "prompt_tokens": 90},
    ]
    live = [  # on the client's clock, 0.2 s behind the trace's
        replace(served(0.2, 0.030, 100), conversation="a"),
        replace(served(0.7, 0.020, 80), conversation="b"),
        replace(served(2.2, 0.050, 300, cached=96), conversation="a"),
        replace(served(2.7, 0.025, 95), conversation="b"),  # its line says 90
    ]
    replayed = [
        served(2.5, 0.021, 90),
        served(0.0, 0.028, 100),
        served(2.0, 0.046, 300, cached=112),
        served(0.5, 0.026, 80),
    ]
    paired = paired_figures(live, lines, replayed)
    assert (paired.live, paired.replayed, paired.pairs) == (4, 4, 3)
    assert paired.hit_differs == 1
    # Errors -2, +6 and -4 ms: the median and the largest size.
    assert paired.ttft_error_p50_s == pytest.approx(-0.002)
    assert paired.ttft_abs_error_p95_s == pytest.approx(0.006)
