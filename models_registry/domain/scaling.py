"""What a pool's autoscaling settings may be: the rules, written once.

Public surface: ``ScheduleWindow``, ``schedule_rule_problems``, ``windows_overlap``,
``scaling_problems``, ``problem_field``, ``MINUTES_PER_DAY``, ``MAX_REPLICAS``,
``MAX_WINDOW_S``, ``MAX_SCALE_DOWN_INTERVAL_S``, ``MAX_PANIC_FACTOR``,
``MAX_SCHEDULE_RULES``.

A pool's settings are ``models_registry.models.Pool`` columns; the autoscaler's
policy (``models_registry.domain.autoscaler.ScalingSettings``) refuses the same
settings on construction by calling these functions, so ``Pool.clean()``, the
control-plane API and the policy agree (the registry cannot import the policy:
``engine_nodes`` depends on the registry, never the reverse).

Each problem is a ``"field: why"`` line naming the setting, which the API turns into
a 400 with that ``param`` and the console into an error on that field. The
``MAX_*`` bounds are what the columns and the API take; the policy itself has none.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

__all__ = [
    "MAX_PANIC_FACTOR",
    "MAX_REPLICAS",
    "MAX_SCALE_DOWN_INTERVAL_S",
    "MAX_SCHEDULE_RULES",
    "MAX_WINDOW_S",
    "MINUTES_PER_DAY",
    "ScheduleWindow",
    "problem_field",
    "scaling_problems",
    "schedule_rule_problems",
    "windows_overlap",
]

MINUTES_PER_DAY = 24 * 60
# Storage and API bounds (not rules of the policy): a pool of 10,000 replicas, a
# window of an hour (Knative's longest stable window), a day between scale-downs.
MAX_REPLICAS = 10_000
MAX_WINDOW_S = 3600.0
MAX_SCALE_DOWN_INTERVAL_S = 86_400.0
MAX_PANIC_FACTOR = 100.0
MAX_SCHEDULE_RULES = 50


class ScheduleWindow(Protocol):
    """A schedule rule as stored or as the policy holds it."""

    @property
    def weekdays(self) -> Collection[int]: ...

    @property
    def start_minute(self) -> int: ...

    @property
    def end_minute(self) -> int: ...

    @property
    def min_replicas(self) -> int: ...


def schedule_rule_problems(
    *,
    weekdays: Collection[int],
    start_minute: int,
    end_minute: int,
    min_replicas: int,
) -> list[str]:
    """Return what is wrong with one schedule rule, as ``"field: why"`` lines."""
    found = []
    if not weekdays or not set(weekdays) <= set(range(7)):
        found.append("weekdays: must be a non-empty set of 0 (Monday) to 6")
    if not 0 <= start_minute < MINUTES_PER_DAY:
        found.append(
            f"start_minute: must be a minute of the day, 0 to {MINUTES_PER_DAY - 1}"
        )
    elif not start_minute < end_minute <= MINUTES_PER_DAY:
        found.append(
            "end_minute: a rule runs from start_minute to a later end_minute "
            f"within one day (at most {MINUTES_PER_DAY})"
        )
    if min_replicas < 0:
        found.append("min_replicas: a rule's min_replicas must be zero or more")
    return found


def windows_overlap(a: ScheduleWindow, b: ScheduleWindow) -> bool:
    """True when the two rules share a minute of some weekday."""
    return bool(set(a.weekdays) & set(b.weekdays)) and (
        a.start_minute < b.end_minute and b.start_minute < a.end_minute
    )


def scaling_problems(
    *,
    min_replicas: int,
    max_replicas: int,
    warm_floor: int,
    target_utilisation: float,
    scale_down_utilisation: float,
    stable_window_s: float,
    panic_window_s: float,
    panic_factor: float,
    scale_down_interval_s: float,
    schedule: Sequence[ScheduleWindow] = (),
    warm_nodes_min: int = 0,
    warm_nodes_max: int = 0,
    warm_horizon_s: float = 360.0,
) -> list[str]:
    """Return what is wrong with a pool's settings, as ``"field: why"`` lines.

    Min above max, thresholds outside (0, 1) or the scale-down threshold not below
    the scale-up one, windows that are not positive or a short window longer than
    the stable one, a panic factor of 1 or less, a schedule floor above max, or
    overlapping schedule rules that ask for different floors. Empty when valid.
    """
    found = []
    if min_replicas < 0:
        found.append("min_replicas: must be zero or more")
    if max_replicas < 1:
        found.append("max_replicas: must be at least 1")
    if min_replicas > max_replicas:
        found.append("min_replicas: must not exceed max_replicas")
    if not 0 <= warm_floor <= max_replicas:
        found.append("warm_floor: must be between 0 and max_replicas")
    if not 0.0 < target_utilisation < 1.0:
        found.append("target_utilisation: must be between 0 and 1")
    if not 0.0 < scale_down_utilisation < target_utilisation:
        found.append(
            "scale_down_utilisation: must be above 0 and below target_utilisation"
        )
    if not stable_window_s > 0:
        found.append("stable_window_s: must be positive")
    if not 0 < panic_window_s <= stable_window_s:
        found.append("panic_window_s: must be positive and at most stable_window_s")
    if not panic_factor > 1.0:
        found.append("panic_factor: must be above 1")
    if not scale_down_interval_s >= 0:
        found.append("scale_down_interval_s: must be zero or more")
    if not 0 <= warm_nodes_min <= warm_nodes_max:
        found.append("warm_nodes_min: must be between 0 and warm_nodes_max")
    if not warm_horizon_s > 0:
        found.append("warm_horizon_s: must be positive")
    for rule in schedule:
        if rule.min_replicas > max_replicas:
            found.append("schedule: a rule's min_replicas exceeds max_replicas")
            break
    for index, rule in enumerate(schedule):
        for other in schedule[index + 1 :]:
            if windows_overlap(rule, other) and rule.min_replicas != other.min_replicas:
                found.append(
                    "schedule: overlapping rules ask for different floors "
                    f"({rule.min_replicas} and {other.min_replicas})"
                )
    return found


def problem_field(problem: str) -> str | None:
    """Return the field a ``"field: why"`` line names (None without one)."""
    field, sep, _ = problem.partition(":")
    return field if sep and field.isidentifier() else None
