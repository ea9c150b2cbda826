"""The gateway's Prometheus collectors: names, bounded labels, per-pool cleanup."""

from __future__ import annotations

import math
import uuid
from typing import Any, TypedDict

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from metering import metrics

POOL = ("model", "version", "region")


@pytest.mark.parametrize(
    ("name", "kind", "labels"),
    [
        ("platform_output_tokens", "counter", POOL),
        ("platform_prompt_tokens", "counter", POOL),
        ("platform_cached_tokens", "counter", POOL),
        ("platform_tokens_in_flight", "gauge", POOL),
        ("platform_queue_depth", "gauge", POOL),
        ("platform_ttft_seconds", "histogram", POOL),
        ("platform_time_per_output_token_seconds", "histogram", POOL),
        ("platform_requests", "counter", (*POOL, "outcome")),
        ("platform_upstream_retries", "counter", POOL),
        ("platform_shadow_requests", "counter", (*POOL, "outcome")),
        ("platform_shadow_ttft_seconds", "histogram", POOL),
        ("platform_team_tokens", "counter", ("team", "model", "kind")),
        ("platform_team_rate_limited", "counter", ("team", "model", "tier")),
        ("platform_team_shed", "counter", ("team", "model", "tier", "cause")),
        ("platform_snapshot_age_seconds", "gauge", ()),
        ("platform_control_plane_up", "gauge", ()),
    ],
)
def test_collector_is_registered_with_bounded_labels(
    name: str, kind: str, labels: tuple[str, ...]
) -> None:
    collector = REGISTRY._names_to_collectors[name]
    assert isinstance(collector, MetricWrapperBase)
    assert collector._type == kind
    assert collector._labelnames == labels


def test_histogram_buckets_cover_their_ranges() -> None:
    assert metrics.TTFT_BUCKETS[0] <= 0.005 and metrics.TTFT_BUCKETS[-1] >= 10
    assert metrics.TPOT_BUCKETS[0] <= 0.005 and metrics.TPOT_BUCKETS[-1] >= 0.5


class PoolLabels(TypedDict):
    model: str
    version: str
    region: str


def pool_labels() -> PoolLabels:
    return {"model": f"m-{uuid.uuid4().hex[:8]}", "version": "v1", "region": "eu"}


def series(pool: PoolLabels, **extra: str) -> dict[str, str]:
    """Return the sample labels of a pool's series, with ``extra`` labels."""
    return {
        "model": pool["model"],
        "version": pool["version"],
        "region": pool["region"],
        **extra,
    }


def test_observe_request_counts_tokens_and_latency() -> None:
    pool = pool_labels()
    metrics.observe_request(
        **pool,
        outcome="ok",
        prompt_tokens=100,
        cached_tokens=40,
        output_tokens=7,
        ttft_s=0.2,
        time_per_output_token_s=0.02,
    )
    metrics.observe_request(**pool, outcome="client_closed", output_tokens=3)

    value = REGISTRY.get_sample_value
    assert value("platform_requests_total", series(pool, outcome="ok")) == 1
    assert value("platform_requests_total", series(pool, outcome="client_closed")) == 1
    assert value("platform_prompt_tokens_total", series(pool)) == 100
    assert value("platform_cached_tokens_total", series(pool)) == 40
    assert value("platform_output_tokens_total", series(pool)) == 10
    assert value("platform_ttft_seconds_count", series(pool)) == 1
    assert value("platform_ttft_seconds_bucket", series(pool, le="0.25")) == 1
    assert value("platform_time_per_output_token_seconds_sum", series(pool)) == 0.02


def test_observe_request_derives_time_per_token_and_team_tokens() -> None:
    pool = pool_labels()
    team = f"t-{uuid.uuid4().hex[:8]}"
    metrics.observe_request(
        **pool,
        outcome="ok",
        team=team,
        prompt_tokens=50,
        output_tokens=11,
        ttft_s=0.5,
        duration_s=1.5,
    )

    value = REGISTRY.get_sample_value
    assert value("platform_time_per_output_token_seconds_sum", series(pool)) == 0.1
    labels = {"team": team, "model": pool["model"]}
    assert value("platform_team_tokens_total", {**labels, "kind": "prompt"}) == 50
    assert value("platform_team_tokens_total", {**labels, "kind": "output"}) == 11


def test_count_rejection_splits_rate_limited_from_shed() -> None:
    team = f"t-{uuid.uuid4().hex[:8]}"
    metrics.count_rejection(team=team, model="chat-7b", tier="batch", status=429)
    metrics.count_rejection(team=team, model="chat-7b", tier="batch", status=503)
    metrics.count_rejection(team=team, model="chat-7b", tier="batch", status=503)

    value = REGISTRY.get_sample_value
    labels = {"team": team, "model": "chat-7b", "tier": "batch"}
    assert value("platform_team_rate_limited_total", labels) == 1
    assert value("platform_team_shed_total", {**labels, "cause": "overload"}) == 2
    assert value("platform_team_shed_total", {**labels, "cause": "no_replica"}) is None


def test_set_control_plane_sets_both_gauges() -> None:
    metrics.set_control_plane(up=False, snapshot_age_s=12.5)
    assert REGISTRY.get_sample_value("platform_control_plane_up") == 0
    assert REGISTRY.get_sample_value("platform_snapshot_age_seconds") == 12.5
    metrics.set_control_plane(up=True, snapshot_age_s=0.0)
    assert REGISTRY.get_sample_value("platform_control_plane_up") == 1


def test_set_control_plane_without_a_snapshot_reads_nan() -> None:
    # A gateway that started with the database down has no snapshot, so no age:
    # the gauge says "no value" instead of raising (Gauge.set(None) is a TypeError).
    metrics.set_control_plane(up=False, snapshot_age_s=None)
    assert REGISTRY.get_sample_value("platform_control_plane_up") == 0
    age = REGISTRY.get_sample_value("platform_snapshot_age_seconds")
    assert age is not None
    assert math.isnan(age)
    assert "platform_snapshot_age_seconds NaN" in generate_latest().decode()
    metrics.set_control_plane(up=True, snapshot_age_s=0.0)
    assert REGISTRY.get_sample_value("platform_snapshot_age_seconds") == 0.0


def test_team_helpers_count_by_kind_and_tier() -> None:
    team = f"t-{uuid.uuid4().hex[:8]}"
    metrics.observe_team_tokens(
        team=team, model="chat-7b", prompt_tokens=5, output_tokens=2
    )
    metrics.count_rate_limited(team=team, model="chat-7b", tier="batch")
    metrics.count_shed(team=team, model="chat-7b", tier="batch", cause="overload")
    metrics.count_shed(team=team, model="chat-7b", tier="batch", cause="no_replica")
    metrics.count_shed(team=team, model="chat-7b", tier="batch", cause="no_replica")

    value = REGISTRY.get_sample_value
    labels = {"team": team, "model": "chat-7b"}
    assert value("platform_team_tokens_total", {**labels, "kind": "prompt"}) == 5
    assert value("platform_team_tokens_total", {**labels, "kind": "output"}) == 2
    assert value("platform_team_tokens_total", {**labels, "kind": "cached"}) is None
    assert value("platform_team_rate_limited_total", {**labels, "tier": "batch"}) == 1
    shed = {**labels, "tier": "batch"}
    assert value("platform_team_shed_total", {**shed, "cause": "overload"}) == 1
    assert value("platform_team_shed_total", {**shed, "cause": "no_replica"}) == 2


def test_forget_pool_removes_its_series_only() -> None:
    gone, kept = pool_labels(), pool_labels()
    for pool in (gone, kept):
        metrics.observe_request(**pool, outcome="error", output_tokens=1, ttft_s=0.1)
        metrics.count_retry(**pool)
        metrics.set_pool_load(**pool, tokens_in_flight=10, queue_depth=2)
        metrics.observe_shadow(**pool, outcome="ok", ttft_s=0.1)

    metrics.forget_pool(gone["model"], gone["version"], gone["region"])

    value = REGISTRY.get_sample_value
    for name in (
        "platform_output_tokens_total",
        "platform_ttft_seconds_count",
        "platform_upstream_retries_total",
        "platform_tokens_in_flight",
        "platform_queue_depth",
        "platform_shadow_ttft_seconds_count",
    ):
        assert value(name, series(gone)) is None, name
        assert value(name, series(kept)) is not None, name
    assert value("platform_requests_total", series(gone, outcome="error")) is None
    assert value("platform_requests_total", series(kept, outcome="error")) == 1


def test_pools_with_series_names_every_pool_a_helper_made_a_series_for() -> None:
    loaded, requested, shadowed, elsewhere = (pool_labels() for _ in range(4))
    elsewhere["region"] = "us"
    metrics.set_pool_load(**loaded, tokens_in_flight=1, queue_depth=0)
    metrics.observe_request(**requested, outcome="error")
    metrics.observe_shadow(**shadowed, outcome="ok", ttft_s=None)
    metrics.count_retry(**elsewhere)

    found = metrics.pools_with_series("eu")

    for pool in (loaded, requested, shadowed):
        assert (pool["model"], pool["version"]) in found
    assert (elsewhere["model"], elsewhere["version"]) not in found
    metrics.forget_pool(requested["model"], requested["version"], "eu")
    assert (requested["model"], requested["version"]) not in (
        metrics.pools_with_series("eu")
    )


def test_forget_pool_keeps_the_team_series() -> None:
    """Team series are per team and model, not per pool: they stay."""
    pool, team = pool_labels(), f"t-{uuid.uuid4().hex[:8]}"
    metrics.observe_request(**pool, outcome="ok", team=team, output_tokens=4)
    metrics.count_shed(team=team, model=pool["model"], tier="batch", cause="overload")

    metrics.forget_pool(pool["model"], pool["version"], pool["region"])

    value = REGISTRY.get_sample_value
    labels = {"team": team, "model": pool["model"]}
    assert value("platform_team_tokens_total", {**labels, "kind": "output"}) == 4
    shed = {**labels, "tier": "batch", "cause": "overload"}
    assert value("platform_team_shed_total", shed) == 1


def test_a_forgotten_pool_counts_from_zero_when_it_returns() -> None:
    pool = pool_labels()
    metrics.observe_request(**pool, outcome="ok", output_tokens=5)
    metrics.forget_pool(pool["model"], pool["version"], pool["region"])
    metrics.observe_request(**pool, outcome="ok", output_tokens=2)

    assert REGISTRY.get_sample_value("platform_output_tokens_total", series(pool)) == 2


def test_pool_scaling_collector_exports_figures_and_survives_a_failed_read() -> None:
    """The autoscaler's figures are read at scrape time; a database that does not
    answer costs those series, never the scrape."""
    from prometheus_client import CollectorRegistry

    figures = metrics.PoolScalingFigures(
        model="chat-7b",
        version="v1",
        region="eu",
        desired_replicas=4,
        serving_replicas=3,
        starting_replicas=1,
        utilisation=None,
        is_capacity_exhausted=True,
        capacity_is_assumed=False,
        is_panicking=False,
        decisions={"utilisation": 2},
    )
    healthy = CollectorRegistry()
    healthy.register(metrics.PoolScalingCollector(lambda: [figures]))
    pool = {"model": "chat-7b", "version": "v1", "region": "eu"}
    assert healthy.get_sample_value("platform_pool_desired_replicas", pool) == 4
    assert healthy.get_sample_value("platform_pool_capacity_exhausted", pool) == 1
    assert healthy.get_sample_value("platform_pool_utilisation", pool) is None
    assert (
        healthy.get_sample_value(
            "platform_autoscaler_decisions_total", {**pool, "reason": "utilisation"}
        )
        == 2
    )

    def unreachable() -> list[metrics.PoolScalingFigures]:
        raise OSError("database down")

    failing = CollectorRegistry()
    failing.register(metrics.PoolScalingCollector(unreachable))
    text = generate_latest(failing).decode()
    assert "platform_pool_desired_replicas" in text  # described, with no sample
    assert "platform_pool_desired_replicas{" not in text


@pytest.mark.parametrize(
    ("collector", "name"),
    [
        (metrics.PoolCostCollector, "platform_pool_gpu_usd_per_hour"),
        (metrics.RolloutCollector, "platform_rollout_open"),
        (metrics.BatchCollector, "platform_batches_at_risk"),
    ],
)
def test_scrape_time_collectors_survive_a_failed_read(
    collector: type[metrics.PoolCostCollector]
    | type[metrics.RolloutCollector]
    | type[metrics.BatchCollector],
    name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A database that does not answer costs these series, never the scrape, and
    the log says what failed without the error's text (it may carry a DSN)."""
    from prometheus_client import CollectorRegistry

    def unreachable() -> list[Any]:
        raise OSError("connection to postgresql://user:secret@db failed")

    failing = CollectorRegistry()
    failing.register(collector(unreachable))
    text = generate_latest(failing).decode()
    assert f"# TYPE {name} gauge" in text  # described, with no sample
    assert f"{name}{{" not in text
    assert "OSError" in caplog.text
    assert "secret" not in caplog.text


def test_pool_cost_collector_exports_each_pools_figures() -> None:
    from prometheus_client import CollectorRegistry

    figures = [
        metrics.PoolCostFigures(
            model="chat-7b",
            version=version,
            region="eu",
            gpus=gpus,
            gpu_usd_per_hour=gpus * 2.5,
            usd_per_million_tokens_at_full=0.28 * gpus,
            silent_replicas=silent,
        )
        for version, gpus, silent in (("v1", 4, 1), ("v2", 2, 0))
    ]
    registry = CollectorRegistry()
    registry.register(metrics.PoolCostCollector(lambda: figures))
    v1 = {"model": "chat-7b", "version": "v1", "region": "eu"}
    v2 = {**v1, "version": "v2"}
    value = registry.get_sample_value
    assert value("platform_pool_gpus", v1) == 4
    assert value("platform_pool_gpu_usd_per_hour", v2) == 5.0
    assert value("platform_pool_usd_per_million_tokens_at_full", v2) == 0.56
    assert value("platform_pool_silent_replicas", v1) == 1
    assert value("platform_pool_silent_replicas", v2) == 0
