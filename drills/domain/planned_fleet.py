"""The chat fleet a drill runs by default: the capacity plan's for the drill's load.

Public surface: ``SEED_NAME``, ``FleetSize``, ``region_peak_rps``,
``at_region_peak``, ``fleet_size``.

A region is sized for the peak it carries when ``regions_lost`` regions are gone
(``peak / (regions - regions_lost)``: with the seed's 2 and 1, the whole peak), so a
drill that replays one region's load runs the plan's
``chat_replicas_per_region_with_prefill`` (prefill counted at the hit rate its
cache model expects: 14 for the seed, not the 12 decode alone needs). A flag that
names a size overrides it; ``FleetSize.source`` says which it was, for the report.
"""

from __future__ import annotations

from dataclasses import dataclass

from drills.domain.capacity_plan import Scenario, plan

__all__ = [
    "SEED_NAME",
    "FleetSize",
    "at_region_peak",
    "fleet_size",
    "region_peak_rps",
]

SEED_NAME = "the seed"


@dataclass(frozen=True, slots=True)
class FleetSize:
    """A drill's chat replicas and where the number came from.

    ``source`` reads "the capacity plan's 14 for the seed" or "--replicas 12".
    """

    replicas: int
    source: str
    is_planned: bool


def region_peak_rps(scenario: Scenario) -> float:
    """Return the chat requests/s one region carries at peak with
    ``regions_lost`` regions gone (the seed: 100)."""
    s = scenario
    total = s.peak_streams * s.stream_tokens_per_s / s.answer_tokens
    return total / (s.regions - s.regions_lost)


def at_region_peak(scenario: Scenario, requests_per_s: float) -> Scenario:
    """Return ``scenario`` with its peak streams set so that one region carries
    ``requests_per_s`` (the drill's own peak, when a flag names one)."""
    s = scenario
    streams = (
        requests_per_s * (s.regions - s.regions_lost) * s.answer_tokens
    ) / s.stream_tokens_per_s
    return s.with_values({"peak_streams": streams})


def fleet_size(
    scenario: Scenario,
    *,
    name: str = SEED_NAME,
    replicas: int | None = None,
    flag: str = "--replicas",
) -> FleetSize:
    """Return ``replicas`` if a flag named them, else the plan's chat replicas
    for one region of ``scenario`` (``name`` says which scenario, for the report).

    Raises ``ValueError`` (``ScenarioError``) when the plan cannot be made.
    """
    if replicas is not None:
        return FleetSize(replicas, f"{flag} {replicas}", is_planned=False)
    n = int(plan(scenario)["chat_replicas_per_region_with_prefill"])
    return FleetSize(n, f"the capacity plan's {n} for {name}", is_planned=True)
