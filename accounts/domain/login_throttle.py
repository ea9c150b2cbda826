"""Console login lockout: how many failed passwords lock a login out, and for how long.

Public surface: ``ThrottleRule``, ``LoginFailures``, ``after_failure``,
``retry_after_s``.

A rule counts failures over a window; the failure that reaches ``max_failures``
within ``window_s`` locks the login out for ``lockout_s``, and while it is locked
out, attempts are refused without the password being checked or counted (so a
guesser learns nothing and cannot keep the lock on forever by hammering). The
state is a small value the caller stores wherever it likes (the console keeps it
in the cache); nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoginFailures", "ThrottleRule", "after_failure", "retry_after_s"]


@dataclass(frozen=True, slots=True)
class ThrottleRule:
    """``max_failures`` failures within ``window_s`` lock out for ``lockout_s``."""

    max_failures: int
    window_s: float
    lockout_s: float

    def __post_init__(self) -> None:
        if self.max_failures < 1:
            raise ValueError("max_failures must be at least 1")
        if self.window_s <= 0 or self.lockout_s <= 0:
            raise ValueError("window_s and lockout_s must be positive")


@dataclass(frozen=True, slots=True)
class LoginFailures:
    """Recent failure times (unix seconds, oldest first) and the lockout's end."""

    times: tuple[float, ...] = ()
    locked_until: float = 0.0


def retry_after_s(state: LoginFailures, now: float) -> float:
    """Return how long the login stays locked out at ``now`` (0: it may try)."""
    return max(0.0, state.locked_until - now)


def after_failure(
    state: LoginFailures, now: float, rule: ThrottleRule
) -> LoginFailures:
    """Return the state after one more failed password at ``now``.

    Failures older than the window are forgotten; reaching ``max_failures`` starts
    a lockout and clears the count, so the next window starts after it.
    """
    if retry_after_s(state, now) > 0:
        return state
    times = (*(t for t in state.times if now - t < rule.window_s), now)
    if len(times) >= rule.max_failures:
        return LoginFailures(times=(), locked_until=now + rule.lockout_s)
    return LoginFailures(times=times[-rule.max_failures :], locked_until=0.0)
