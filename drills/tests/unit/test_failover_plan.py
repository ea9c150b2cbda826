"""The failover drill's fleet comes from the capacity plan, not a constant."""

from __future__ import annotations

import dataclasses

import pytest

from drills.domain.capacity_plan import Scenario, plan
from drills.domain.failover_drill import planned_scenario


def test_each_region_gets_the_plans_fleet_prefill_counted() -> None:
    capacity = plan(Scenario())
    scenario = planned_scenario(capacity)
    assert scenario.chat_replicas == capacity["chat_replicas_per_region_with_prefill"]
    # The seed's decode-only count is smaller: the plan's prefill makes it 14.
    assert scenario.chat_replicas > capacity["chat_replicas_per_region"]
    assert scenario.reasoning_replicas == capacity["big_replicas_per_region"]
    assert scenario.peak_rps == pytest.approx(capacity["chat_requests_per_s"])


def test_a_scenario_with_more_regions_sizes_each_smaller() -> None:
    two = planned_scenario(plan(Scenario()))
    four = planned_scenario(plan(dataclasses.replace(Scenario(), regions=4)))
    assert four.chat_replicas < two.chat_replicas
    assert planned_scenario(plan(Scenario()), chat_replicas=9).chat_replicas == 9
