"""The embedding drill and the capacity plan size the same pool alike: the plan's
replicas per region are what the drill's burst needs, and the size the drill's
autoscaler settles at is the plan's or within its hysteresis band above it."""

from __future__ import annotations

import math

import pytest

from drills.domain.capacity_plan import Scenario, plan
from drills.domain.embedding_drill import (
    EmbeddingPerf,
    EmbeddingReport,
    EmbeddingScenario,
    at_profile,
    capacity_plan_keys,
    run_embedding_drill,
)
from simengine.domain.embedding_perf import EMBEDDING_PROFILES

A100 = EMBEDDING_PROFILES["a100-minilm"]
SMALL = EmbeddingScenario(
    duration_s=1_200.0, burst_at_s=120.0, burst_s=480.0, ingest_rps=12.0, query_rps=5
)


def plan_replicas(s: EmbeddingScenario) -> int:
    return int(
        plan(Scenario.from_mapping(capacity_plan_keys(s)))[
            "embedding_replicas_per_region"
        ]
    )


def settled(report: EmbeddingReport) -> int:
    s = report.scenario
    end = s.burst_at_s + s.burst_s
    return [d for d in report.decisions if d.at < end][-1].desired


def test_the_perf_of_a_profile_is_its_batch_time() -> None:
    perf = EmbeddingPerf.from_profile(A100)
    for tokens in (1, 1_000, A100.max_batch_tokens):
        assert perf.batch_s(tokens) == pytest.approx(A100.batch_seconds(tokens))
    assert perf.max_batch_tokens == A100.max_batch_tokens


def test_at_profile_takes_the_profiles_capacity_as_the_load_tests() -> None:
    s = at_profile(EmbeddingScenario(), A100)
    assert s.replica_tokens_per_s == A100.full_batch_tokens_per_s
    # What that rate keeps in flight over the latency target.
    assert s.replica_tokens_in_flight == round(
        A100.full_batch_tokens_per_s * s.latency_target_s
    )
    assert s.perf == EmbeddingPerf.from_profile(A100)


@pytest.mark.parametrize(
    "scenario",
    [EmbeddingScenario(), SMALL, at_profile(EmbeddingScenario(), A100)],
    ids=["seed-drill-figures", "small", "seed-a100"],
)
def test_the_plan_needs_what_the_drills_burst_needs(
    scenario: EmbeddingScenario,
) -> None:
    demand = scenario.burst_tokens_per_s + scenario.query_tokens_per_s
    expected = math.ceil(demand / (0.7 * scenario.replica_tokens_per_s))
    assert plan_replicas(scenario) == scenario.needed_at_burst == expected


def test_the_drills_settled_pool_is_within_the_plans_band() -> None:
    report = run_embedding_drill(SMALL)
    planned = plan_replicas(SMALL)
    size = settled(report)
    demand = SMALL.burst_tokens_per_s + SMALL.query_tokens_per_s
    # At least the plan's count (the fewest under the target), and no more than
    # one fewer would leave at or above the scale-down threshold.
    assert planned <= size
    assert demand / ((size - 1) * SMALL.replica_tokens_per_s) >= 0.5


def test_at_gpu_speed_the_seeds_burst_is_one_replica_in_drill_and_plan() -> None:
    """The A100 estimate carries the drill's whole burst (60 requests/s of 32 x
    256 tokens and 50 queries: 493,120 input tokens/s) on one replica: the
    autoscaler never leaves its floor and the plan asks for one."""
    scenario = at_profile(
        EmbeddingScenario(duration_s=900.0, burst_at_s=120.0, burst_s=480.0), A100
    )
    report = run_embedding_drill(scenario)
    assert plan_replicas(scenario) == 1
    assert report.peak_desired == 1
    assert all(
        b.p95_latency_s is None or b.p95_latency_s < scenario.latency_target_s
        for b in report.bins
    )
