"""The simulated replica's engine loop keeps the model's pace in real time."""

from __future__ import annotations

from simengine.replica import next_step_start


def test_next_step_starts_where_the_last_one_ended_despite_a_small_lag() -> None:
    # The loop woke 0.7 ms after the step's model end (its own work, timers).
    assert next_step_start(10.0007, 10.0, last_arrival=9.0, max_lag_s=0.005) == 10.0


def test_next_step_starts_now_after_a_stall_or_when_idle() -> None:
    assert next_step_start(10.02, 10.0, last_arrival=9.0, max_lag_s=0.005) == 10.02
    assert next_step_start(10.02, None, last_arrival=9.0, max_lag_s=0.005) == 10.02


def test_next_step_never_starts_before_the_last_arrival() -> None:
    # A request came in after the last step ended: it cannot be scheduled earlier.
    start = next_step_start(10.003, 10.0, last_arrival=10.002, max_lag_s=0.005)

    assert start == 10.002
