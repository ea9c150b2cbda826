"""A drill's default fleet is the capacity plan's for one region, not a constant."""

from __future__ import annotations

import pytest

from drills.domain.capacity_plan import Scenario, plan
from drills.domain.planned_fleet import at_region_peak, fleet_size, region_peak_rps


def test_fleet_size_is_the_plans_chat_replicas_prefill_counted() -> None:
    size = fleet_size(Scenario())
    capacity = plan(Scenario())
    assert size.replicas == capacity["chat_replicas_per_region_with_prefill"]
    # The seed's decode-only 12 is not what a drill runs: prefill makes it 14.
    assert size.replicas > capacity["chat_replicas_per_region"]
    assert size.is_planned
    assert size.source == f"the capacity plan's {size.replicas} for the seed"


def test_a_flag_overrides_the_plan_and_says_so() -> None:
    size = fleet_size(Scenario(), replicas=12, flag="--plan-replicas")
    assert (size.replicas, size.source, size.is_planned) == (
        12,
        "--plan-replicas 12",
        False,
    )


def test_regions_lost_sets_the_peak_a_region_carries() -> None:
    seed = Scenario()
    assert region_peak_rps(seed) == pytest.approx(100.0)
    three = seed.with_values({"regions": 3})
    assert region_peak_rps(three) == pytest.approx(50.0)
    assert fleet_size(three).replicas < fleet_size(seed).replicas
    none_lost = seed.with_values({"regions": 3, "regions_lost": 0})
    assert fleet_size(none_lost).replicas < fleet_size(three).replicas


def test_at_region_peak_plans_for_the_drills_own_peak() -> None:
    seed = Scenario()
    assert at_region_peak(seed, 100.0) == seed
    small = at_region_peak(seed.with_values({"regions": 3}), 12.0)
    assert region_peak_rps(small) == pytest.approx(12.0)
    assert fleet_size(small).replicas == fleet_size(at_region_peak(seed, 12.0)).replicas


def test_the_batch_drill_runs_the_plans_fleet_under_the_seeds_load() -> None:
    from dataclasses import replace

    from drills.domain.batch_drill import BatchScenario

    scenario = BatchScenario()
    assert scenario.replicas == fleet_size(Scenario()).replicas
    # The interactive day is the seed's half-busy 12, whatever the fleet: more
    # replicas leave more idle capacity, not more interactive traffic.
    seed_12 = replace(scenario, replicas=12)
    assert scenario.peak_rps() == pytest.approx(seed_12.peak_rps())
    assert scenario.peak_rps() * 300 > 0.5 * 12 * 2500
    assert replace(scenario, load_replicas=14).peak_rps() > scenario.peak_rps()
    # The bulk jobs grow with the idle capacity: 10 for 12 replicas.
    assert seed_12.backfill_count == 10
    assert scenario.backfill_count == 12
    assert replace(scenario, backfill_jobs=3).backfill_count == 3
    with pytest.raises(ValueError, match="load_replicas"):
        replace(scenario, load_replicas=0)
