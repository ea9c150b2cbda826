"""How a drill command sizes its chat fleet: from the capacity plan for its
scenario (``drills.domain.planned_fleet``), unless a flag names the replicas.

Public surface: ``add_scenario_argument``, ``capacity_scenario``,
``planned_fleet_size``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from django.core.management.base import CommandError

from drills.domain.capacity_plan import Scenario, ScenarioError
from drills.domain.planned_fleet import (
    SEED_NAME,
    FleetSize,
    at_region_peak,
    fleet_size,
    region_peak_rps,
)

__all__ = ["add_scenario_argument", "capacity_scenario", "planned_fleet_size"]


def add_scenario_argument(parser: Any, flag: str = "--scenario") -> None:
    """Add ``flag`` (to a parser or an argument group): the capacity-plan
    scenario file the default fleet is planned for."""
    parser.add_argument(
        flag,
        type=Path,
        dest="capacity_scenario",
        help="capacity-plan scenario file (YAML or JSON, as capacity_plan's): the "
        "default fleet is the plan's for one region of it (default the seed)",
    )


def capacity_scenario(path: Path | None) -> tuple[Scenario, str]:
    """Return the capacity plan's scenario, the seed's or the file's, and its
    name for the report."""
    if path is None:
        return Scenario(), SEED_NAME
    from drills.management.commands.capacity_plan import read_scenario

    try:
        return Scenario.from_mapping(read_scenario(path)), str(path)
    except ScenarioError as exc:
        raise CommandError(f"invalid scenario: {exc}") from None


def planned_fleet_size(
    scenario: Scenario,
    name: str,
    *,
    replicas: int | None,
    flag: str = "--replicas",
    peak_rps: float | None = None,
) -> FleetSize:
    """Return the fleet a drill runs: ``replicas`` if its flag named them, else
    the plan's for one region of ``scenario`` (named ``name``; at ``peak_rps`` a
    region when the drill's own peak differs from the scenario's)."""
    try:
        if (
            replicas is None
            and peak_rps is not None
            and not math.isclose(peak_rps, region_peak_rps(scenario))
        ):
            scenario = at_region_peak(scenario, peak_rps)
            name = f"{name} at {peak_rps:g} req/s a region"
        return fleet_size(scenario, name=name, replicas=replicas, flag=flag)
    except ScenarioError as exc:
        raise CommandError(f"invalid scenario: {exc}") from None
