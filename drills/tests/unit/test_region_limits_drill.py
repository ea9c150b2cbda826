"""One team limit across two regions in virtual time (drills.domain.region_limits)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from drills.domain.region_limits import RegionLimitsScenario, run_region_limits
from routing.domain.region_shares import ShareOptions


@pytest.mark.parametrize("seed", [0, 1])
def test_region_limits_drill_holds_the_targets(seed: int) -> None:
    report = run_region_limits(
        RegionLimitsScenario(
            duration_s=200.0, shift_at_s=90.0, loss_at_s=170.0, seed=seed
        )
    )

    assert report.passed, report.checks
    assert report.survivor_s <= 10.0
    # The team on both regions is held to its limit once the first burst is spent.
    assert max(f for end, f in report.both_minutes if end >= 120.0) <= 1.10


def test_region_limits_drill_without_the_floor_misses_nothing_but_a_quiet_start() -> (
    None
):
    """Shares that ignore demand (an equal split) would give the one-region team
    half its limit: the drill sees it."""
    scenario = RegionLimitsScenario(duration_s=150.0, shift_at_s=90.0, loss_at_s=140.0)
    even = replace(scenario, options=ShareOptions(floor=0.5))
    report = run_region_limits(even)

    assert not report.passed
    assert min(f for end, f in report.one_minutes if end >= 120.0) < 0.6
