"""The console's lockout rule: failures in a window lock out, then expire."""

from __future__ import annotations

import pytest

from accounts.domain.login_throttle import (
    LoginFailures,
    ThrottleRule,
    after_failure,
    retry_after_s,
)

RULE = ThrottleRule(max_failures=3, window_s=60.0, lockout_s=300.0)


def fail_at(*times: float, state: LoginFailures | None = None) -> LoginFailures:
    state = state or LoginFailures()
    for now in times:
        state = after_failure(state, now, RULE)
    return state


def test_failures_below_the_limit_do_not_lock_out() -> None:
    state = fail_at(0.0, 1.0)
    assert retry_after_s(state, 1.0) == 0.0
    assert state.times == (0.0, 1.0)


def test_the_failure_that_reaches_the_limit_locks_out_for_the_lockout() -> None:
    state = fail_at(0.0, 1.0, 2.0)
    assert retry_after_s(state, 2.0) == 300.0
    assert retry_after_s(state, 301.0) == 1.0
    assert retry_after_s(state, 302.0) == 0.0


def test_failures_outside_the_window_are_forgotten() -> None:
    state = fail_at(0.0, 1.0, 61.5)
    assert retry_after_s(state, 61.5) == 0.0
    assert state.times == (61.5,)


def test_attempts_during_a_lockout_neither_count_nor_extend_it() -> None:
    locked = fail_at(0.0, 1.0, 2.0)
    again = fail_at(100.0, 200.0, 299.0, state=locked)
    assert again == locked
    assert retry_after_s(again, 302.0) == 0.0


def test_the_count_starts_afresh_after_a_lockout() -> None:
    state = fail_at(0.0, 1.0, 2.0, 400.0, 401.0)
    assert retry_after_s(state, 401.0) == 0.0
    assert retry_after_s(fail_at(402.0, state=state), 402.0) == 300.0


@pytest.mark.parametrize(
    ("max_failures", "window_s", "lockout_s"),
    [(0, 1.0, 1.0), (1, 0.0, 1.0), (1, 1.0, -1.0)],
)
def test_rule_refuses_nonsense(
    max_failures: int, window_s: float, lockout_s: float
) -> None:
    with pytest.raises(ValueError):
        ThrottleRule(max_failures=max_failures, window_s=window_s, lockout_s=lockout_s)
