"""Tests for the missed-heartbeat rule."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from engine_nodes.domain.liveness import ReplicaState, is_silent, silence_cutoff

NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
BEAT_S = 1.0
MISSED_BEATS = 3
CUTOFF = NOW - timedelta(seconds=3)


def test_silence_cutoff_is_beats_times_interval_before_now() -> None:
    assert silence_cutoff(NOW, BEAT_S, MISSED_BEATS) == CUTOFF


def test_silence_cutoff_handles_fractional_beats() -> None:
    assert silence_cutoff(NOW, 0.25, 3) == NOW - timedelta(milliseconds=750)


def test_is_silent_false_exactly_at_cutoff() -> None:
    assert not is_silent(CUTOFF, NOW, BEAT_S, MISSED_BEATS)


def test_is_silent_true_just_past_cutoff() -> None:
    last = CUTOFF - timedelta(microseconds=1)
    assert is_silent(last, NOW, BEAT_S, MISSED_BEATS)


@pytest.mark.parametrize(
    "age", [timedelta(0), timedelta(seconds=1), timedelta(seconds=2.999999)]
)
def test_is_silent_false_for_recent_heartbeat(age: timedelta) -> None:
    assert not is_silent(NOW - age, NOW, BEAT_S, MISSED_BEATS)


def test_is_silent_false_for_heartbeat_after_now() -> None:
    # Clock skew between processes: a beat "from the future" is not silence.
    assert not is_silent(NOW + timedelta(seconds=1), NOW, BEAT_S, MISSED_BEATS)


def test_is_silent_true_when_never_beat() -> None:
    assert is_silent(None, NOW, BEAT_S, MISSED_BEATS)


def test_is_silent_depends_on_missed_beats() -> None:
    last = NOW - timedelta(seconds=4)
    assert is_silent(last, NOW, BEAT_S, missed_beats=3)
    assert not is_silent(last, NOW, BEAT_S, missed_beats=5)


def test_replica_state_values_are_the_seed_states_plus_stalled_and_gone() -> None:
    assert [s.value for s in ReplicaState] == [
        "starting",
        "loading",
        "serving",
        "stalled",
        "draining",
        "gone",
    ]
