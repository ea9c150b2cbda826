"""The rules of a pool's autoscaling settings, shared by the model, the API and the
autoscaler's policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from models_registry.domain.scaling import (
    problem_field,
    scaling_problems,
    schedule_rule_problems,
    windows_overlap,
)

VALID: dict[str, Any] = {
    "min_replicas": 1,
    "max_replicas": 10,
    "warm_floor": 0,
    "target_utilisation": 0.7,
    "scale_down_utilisation": 0.5,
    "stable_window_s": 60.0,
    "panic_window_s": 6.0,
    "panic_factor": 2.0,
    "scale_down_interval_s": 600.0,
}


@dataclass(frozen=True)
class Rule:
    weekdays: frozenset[int]
    start_minute: int
    end_minute: int
    min_replicas: int


def problems_of(*rules: Rule, **changes: Any) -> list[str]:
    """Return the problems of the valid settings with ``changes`` and ``rules``."""
    values: dict[str, Any] = {**VALID, **changes}
    return scaling_problems(**values, schedule=rules)


def test_valid_settings_have_no_problems() -> None:
    assert problems_of() == []


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"min_replicas": 11}, "min_replicas"),
        ({"max_replicas": 0, "min_replicas": 0}, "max_replicas"),
        ({"warm_floor": 11}, "warm_floor"),
        ({"target_utilisation": 1.0}, "target_utilisation"),
        ({"scale_down_utilisation": 0.7}, "scale_down_utilisation"),
        ({"stable_window_s": 0.0, "panic_window_s": 0.0}, "stable_window_s"),
        ({"panic_window_s": 61.0}, "panic_window_s"),
        ({"panic_factor": 1.0}, "panic_factor"),
        ({"scale_down_interval_s": -1.0}, "scale_down_interval_s"),
    ],
)
def test_each_problem_names_its_field(changes: dict[str, float], field: str) -> None:
    problems = problems_of(**changes)
    assert problems
    assert problem_field(problems[0]) == field


def test_schedule_rules_that_overlap_must_agree_and_fit_under_max() -> None:
    weekdays = Rule(frozenset(range(5)), 8 * 60 + 30, 10 * 60, 4)
    monday_late = Rule(frozenset({0}), 9 * 60, 11 * 60, 6)
    saturday = Rule(frozenset({5}), 9 * 60, 11 * 60, 6)
    assert windows_overlap(weekdays, monday_late)
    assert not windows_overlap(weekdays, saturday)
    # Touching windows share no minute: the end is excluded.
    assert not windows_overlap(weekdays, Rule(frozenset({0}), 10 * 60, 11 * 60, 6))

    disagreeing = problems_of(weekdays, monday_late)
    assert [problem_field(p) for p in disagreeing] == ["schedule"]
    assert problems_of(weekdays, saturday) == []
    too_high = Rule(frozenset({6}), 0, 60, 11)
    assert problem_field(problems_of(too_high)[0]) == "schedule"


@pytest.mark.parametrize(
    ("rule", "field"),
    [
        ({"weekdays": []}, "weekdays"),
        ({"weekdays": [7]}, "weekdays"),
        ({"start_minute": 1440, "end_minute": 1440}, "start_minute"),
        ({"start_minute": 600, "end_minute": 600}, "end_minute"),
        ({"end_minute": 1441}, "end_minute"),
        ({"min_replicas": -1}, "min_replicas"),
    ],
)
def test_a_schedule_rule_names_what_is_wrong(
    rule: dict[str, object], field: str
) -> None:
    values: dict[str, Any] = {
        "weekdays": [0],
        "start_minute": 510,
        "end_minute": 600,
        "min_replicas": 2,
        **rule,
    }
    problems = schedule_rule_problems(**values)
    assert [problem_field(p) for p in problems] == [field]
