"""The autoscaler's policy for an embedding pool: input tokens per second."""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from models_registry.domain.autoscaler import (
    AutoscalerState,
    PoolKind,
    PoolSignals,
    Reason,
    ScalingDecision,
    ScalingSettings,
    admitted_rate,
    decide,
)

PER_REPLICA_TOKENS_PER_S = 10_000.0
IN_FLIGHT = 400  # the load test's tokens in flight at that rate
MONDAY_NOON = datetime(2026, 11, 30, 12, 0, tzinfo=UTC).timestamp()
WIDE = ScalingSettings(
    min_replicas=1,
    max_replicas=50,
    stable_window_s=60.0,
    panic_window_s=6.0,
    scale_down_interval_s=30.0,
)


def embedding(
    at: float,
    *,
    serving: int,
    admitted: dict[str, int] | None,
    starting: int = 0,
    in_flight: int = 0,
    queued_tokens: int = 0,
    queue_depth: int = 0,
) -> PoolSignals:
    return PoolSignals(
        at=at,
        serving=serving,
        starting=starting,
        tokens_in_flight=in_flight,
        queued_tokens=queued_tokens,
        queue_depth=queue_depth,
        replica_tokens_in_flight=IN_FLIGHT,
        kind=PoolKind.EMBEDDING,
        admitted_tokens=admitted,
        replica_tokens_per_s=PER_REPLICA_TOKENS_PER_S,
    )


def steady(
    rate: float, *, serving: int, start: float, ticks: int, step_s: float = 5.0
) -> list[PoolSignals]:
    """Ticks of one gateway admitting ``rate`` input tokens a second, with the
    tokens in flight the load test's ratio gives at that rate."""
    return [
        embedding(
            start + i * step_s,
            serving=serving,
            admitted={"gw-1": round(rate * i * step_s)},
            in_flight=round(rate * IN_FLIGHT / PER_REPLICA_TOKENS_PER_S),
        )
        for i in range(ticks)
    ]


def run(
    settings: ScalingSettings,
    observations: list[PoolSignals],
    state: AutoscalerState | None = None,
) -> tuple[list[ScalingDecision], AutoscalerState]:
    state = state or AutoscalerState()
    decisions = []
    for observation in observations:
        decision, state = decide(settings, state, observation)
        decisions.append(decision)
    return decisions, state


def test_admitted_rate_is_the_counts_growth_over_the_interval() -> None:
    rate = admitted_rate({"a": 1_000, "b": 50}, 10.0, {"a": 6_000, "b": 5_050}, 15.0)
    assert rate == 2_000.0


def test_admitted_rate_counts_a_restarted_gateway_from_zero_and_a_new_one_not() -> None:
    # "a" restarted (its count fell): all 300 are new; "c" is new: baseline only;
    # "b" is gone: nothing.
    rate = admitted_rate({"a": 9_000, "b": 50}, 0.0, {"a": 300, "c": 10**9}, 2.0)
    assert rate == 150.0


def test_admitted_rate_is_unknown_without_an_earlier_reading_or_time() -> None:
    assert admitted_rate({}, None, {"a": 10**6}, 5.0) is None
    assert admitted_rate({"a": 1}, 5.0, {"a": 10**6}, 5.0) is None


@given(
    st.lists(
        st.lists(st.integers(min_value=0, max_value=10**6), min_size=3, max_size=3),
        min_size=2,
        max_size=12,
    ),
    st.floats(min_value=0.5, max_value=30.0),
)
def test_admitted_rate_over_ticks_adds_up_to_every_token_admitted(
    increments: list[list[int]], step_s: float
) -> None:
    """Three gateways that never restart: the rates times the intervals are the
    tokens admitted after the first reading, never a negative rate."""
    ids = ("a", "b", "c")
    counts = dict.fromkeys(ids, 0)
    before: dict[str, int] = dict(counts)
    total = 0.0
    for tick, added in enumerate(increments[1:], start=1):
        counts = {g: counts[g] + n for g, n in zip(ids, added, strict=True)}
        rate = admitted_rate(before, (tick - 1) * step_s, counts, tick * step_s)
        assert rate is not None and rate >= 0
        total += rate * step_s
        before = dict(counts)
    expected = sum(sum(added) for added in increments[1:])
    assert total == pytest.approx(expected, rel=1e-9, abs=1e-6)


def test_an_embedding_pool_is_sized_on_input_tokens_per_second() -> None:
    # 30,000 input tokens/s at 70% of 10,000 a replica: ceil(30,000 / 7,000) = 5,
    # in one decision, at the first tick that measures the rate.
    decisions, _ = run(WIDE, steady(30_000, serving=1, start=MONDAY_NOON, ticks=2))
    # The first reading has nothing to measure against: tokens in flight stand
    # in (here at the load test's ratio, so they agree).
    assert decisions[0].desired == 5
    assert decisions[1].desired == 5
    assert decisions[1].reason == Reason.PANIC
    assert decisions[1].signals["admitted_tokens_per_s"] == 30_000
    assert decisions[1].signals["replica_tokens_per_s"] == PER_REPLICA_TOKENS_PER_S
    assert decisions[1].utilisation == pytest.approx(3.0)


def test_tokens_in_flight_do_not_size_an_embedding_pool_with_counts() -> None:
    # Once a reading is there to measure against, a snapshot of many tokens in
    # flight with a trickle admitted holds.
    observations = [
        embedding(
            MONDAY_NOON + t,
            serving=2,
            admitted={"gw": 100 * int(t)},
            in_flight=0 if t == 0 else 10**6,
        )
        for t in (0.0, 5.0, 10.0)
    ]
    decisions, _ = run(WIDE, observations)
    assert [d.desired for d in decisions] == [2, 2, 2]
    assert all(d.reason == Reason.HOLD for d in decisions)
    assert decisions[-1].signals["admitted_tokens_per_s"] == 100


def test_without_counts_tokens_in_flight_stand_in_at_the_load_tests_ratio() -> None:
    # 1,000 tokens in flight x (10,000 tokens/s / 400 in flight) = 25,000 tokens/s.
    decision, _ = decide(
        WIDE,
        AutoscalerState(),
        embedding(MONDAY_NOON, serving=1, admitted=None, in_flight=1_000),
    )
    assert decision.signals["admitted_tokens_per_s"] == 25_000
    assert decision.desired == 4  # ceil(25,000 / 7,000)


def test_queued_tokens_count_as_a_rate_to_drain_within_the_short_window() -> None:
    # 6,000 input tokens/s holds one replica (under 7,000); with 12,000 tokens
    # queued over the 6 s window on top: 8,000 tokens/s, and two replicas.
    calm = steady(6_000, serving=1, start=MONDAY_NOON, ticks=3)
    decisions, _ = run(WIDE, calm)
    assert [d.desired for d in decisions] == [1, 1, 1]
    queued = [
        calm[0],
        *(
            embedding(
                o.at,
                serving=1,
                admitted=dict(o.admitted_tokens or {}),
                queued_tokens=12_000,
                queue_depth=3,
            )
            for o in calm[1:]
        ),
    ]
    decisions, _ = run(WIDE, queued)
    assert decisions[-1].signals["short_demand"] == pytest.approx(8_000.0)
    assert decisions[-1].desired == 2


def test_an_embedding_pool_scales_down_one_at_a_time_once_quiet() -> None:
    """GIVEN five replicas after a burst, WHEN the rate falls to 5,000 tokens/s,
    THEN one replica leaves per interval once a stable window stayed under 50% at
    the smaller size, and never below what the rate needs (ceil(5,000 / 7,000))."""
    start = MONDAY_NOON
    burst = steady(30_000, serving=1, start=start, ticks=2)
    decisions, state = run(WIDE, burst)
    assert decisions[-1].desired == 5
    count = 30_000 * 5
    sizes, serving, at = [], 5, start + 5.0
    for _ in range(120):  # ten minutes of ticks
        at += 5.0
        count += 5_000 * 5
        decision, state = decide(
            WIDE, state, embedding(at, serving=serving, admitted={"gw-1": count})
        )
        if decision.desired != serving:
            sizes.append((at - start, decision.desired, decision.reason))
            serving = decision.desired
    assert [size for _, size, _ in sizes] == [4, 3, 2]
    assert all(reason == Reason.SCALE_DOWN for _, _, reason in sizes)
    # The panic held scale-down off for a stable window; then one per interval.
    assert sizes[0][0] >= WIDE.stable_window_s
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(sizes)]
    assert all(gap >= WIDE.scale_down_interval_s for gap in gaps)
    # 5,000 tokens/s on two replicas is 25% each; one would be at 50%: the
    # threshold is not crossed, so two stay (hysteresis).


def test_an_idle_embedding_pool_falls_to_its_floor() -> None:
    decisions, _ = run(WIDE, steady(0, serving=3, start=MONDAY_NOON, ticks=40))
    changed = [d for d in decisions if d.changed]
    assert changed and {d.desired for d in changed} == {2}
    assert {d.reason for d in changed} == {Reason.SCALE_DOWN}


def test_max_replicas_caps_an_embedding_pool() -> None:
    settings = ScalingSettings(min_replicas=1, max_replicas=3)
    decisions, _ = run(settings, steady(100_000, serving=1, start=MONDAY_NOON, ticks=2))
    assert (decisions[-1].desired, decisions[-1].reason) == (3, Reason.CEILING)


def test_an_embedding_replica_without_a_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="input tokens/s"):
        PoolSignals(
            at=0.0,
            serving=1,
            starting=0,
            tokens_in_flight=0,
            queued_tokens=0,
            queue_depth=0,
            replica_tokens_in_flight=1,
            kind=PoolKind.EMBEDDING,
        )


def test_a_chat_pool_ignores_the_counts() -> None:
    chat = PoolSignals(
        at=MONDAY_NOON,
        serving=1,
        starting=0,
        tokens_in_flight=50,
        queued_tokens=0,
        queue_depth=0,
        replica_tokens_in_flight=100,
        admitted_tokens={"gw": 10**9},
    )
    decision, state = decide(WIDE, AutoscalerState(), chat)
    assert decision.signals["short_demand"] == 50
    assert "admitted_tokens_per_s" not in decision.signals
    assert state.admitted_at == MONDAY_NOON  # kept, harmless, for a kind change


def test_embedding_state_round_trips_through_json_primitives() -> None:
    _, state = run(WIDE, steady(30_000, serving=1, start=MONDAY_NOON, ticks=3))
    assert state.admitted and state.admitted_at is not None

    restored = AutoscalerState.from_dict(json.loads(json.dumps(state.as_dict())))

    assert restored == state
    following = embedding(MONDAY_NOON + 15.0, serving=5, admitted={"gw-1": 30_000 * 15})
    assert decide(WIDE, restored, following) == decide(WIDE, state, following)
