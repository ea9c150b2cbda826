"""Tests for rollout stages, canary steps and guard thresholds."""

from __future__ import annotations

import dataclasses
import math

import pytest

from rollouts.domain.plan import (
    CANARY_STEPS,
    Decision,
    GuardThresholds,
    Stage,
    stage_errors,
)


@pytest.mark.parametrize(
    ("stage", "percent"),
    [("shadow", 100.0), ("canary", 1.0), ("canary", 50.0), ("canary", 0.001)],
)
def test_stage_errors_empty_for_valid_stage_and_share(
    stage: str, percent: float
) -> None:
    assert stage_errors(stage, percent) == []


@pytest.mark.parametrize("stage", ["", "Canary", "live", "blue-green"])
def test_stage_errors_rejects_unknown_stage(stage: str) -> None:
    errors = stage_errors(stage, 10.0)
    assert errors == [("stage", "must be one of ['shadow', 'canary']")]


@pytest.mark.parametrize("percent", [0.0, -1.0, 100.01, 1000.0, math.nan, math.inf])
def test_stage_errors_rejects_share_outside_zero_to_hundred(percent: float) -> None:
    assert stage_errors("canary", percent) == [
        ("percent", "must be greater than 0 and at most 100")
    ]


def test_stage_errors_reports_stage_before_share() -> None:
    assert [param for param, _ in stage_errors("bogus", 0.0)] == ["stage"]


def test_canary_steps_are_the_seed_steps() -> None:
    assert CANARY_STEPS == (1.0, 10.0, 50.0)


def test_canary_steps_are_valid_canary_shares() -> None:
    assert all(stage_errors("canary", step) == [] for step in CANARY_STEPS)


def test_guard_thresholds_defaults_are_the_seed_values() -> None:
    guards = GuardThresholds()
    assert guards.error_rate_points == 0.5
    assert guards.p95_ttft_ratio == 0.20
    assert guards.output_length_ratio == 0.15


def test_guard_thresholds_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        GuardThresholds().error_rate_points = 1.0  # type: ignore[misc]  # frozen on purpose


def test_stage_and_decision_values() -> None:
    assert [s.value for s in Stage] == ["shadow", "canary"]
    assert [d.value for d in Decision] == [
        "pending",
        "promoted",
        "rolled_back",
        "superseded",
        "aborted",
    ]
