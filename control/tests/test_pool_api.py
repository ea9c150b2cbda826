"""A pool's autoscaling through the control plane: its settings (GET and PUT), the
pool state, and the figures at /metrics."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import time_machine
from django.test import Client
from prometheus_client import REGISTRY
from pytest_django import DjangoAssertNumQueries, Settings
from rest_framework.test import APIClient

from control import autoscaling
from control.api.serializers import (
    AutoscalingOutSerializer,
    DecisionSerializer,
    PoolSerializer,
    PoolStateSerializer,
    ReplicaStateSerializer,
)
from control.autoscaling import (
    AutoscalingOut,
    DecisionOut,
    PoolOut,
    PoolStateOut,
    ReplicaStateOut,
    ScheduleRuleOut,
)
from engine_nodes.models import ScalingDecision
from models_registry import services as registry_services
from models_registry.models import SCALING_FIELDS, ModelVersion, Pool, PoolSchedule
from tests.factories import ReplicaFactory, digest, version_body

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
URL = "/admin/pools/chat-7b/v1/eu/autoscaling"
WEEKDAY_MORNINGS = {
    "weekdays": [4, 0, 1, 2, 3],
    "start_minute": 510,
    "end_minute": 600,
    "min_replicas": 6,
}


@pytest.fixture
def pool(chat_v1: ModelVersion) -> Pool:
    return Pool.objects.create(
        model=chat_v1.model,
        version=chat_v1,
        region="eu",
        min_replicas=1,
        max_replicas=10,
        desired_replicas=3,
        autoscaler_state={"state": {"samples": [[1.0, 5, 0]]}},
    )


def error_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"type", "message", "param", "code"}
    assert error["message"]
    return error


def test_get_autoscaling_shows_the_policys_defaults(
    admin_client: APIClient, pool: Pool
) -> None:
    response = admin_client.get(URL)

    assert response.status_code == 200, response.content
    data = response.json()
    assert set(data) == set(AutoscalingOutSerializer().fields)
    assert data["target_utilisation"] == 0.7
    assert data["scale_down_utilisation"] == 0.5
    assert (data["stable_window_s"], data["panic_window_s"]) == (60.0, 6.0)
    assert (data["panic_factor"], data["scale_down_interval_s"]) == (2.0, 600.0)
    assert (data["warm_floor"], data["desired_replicas"], data["schedule"]) == (
        0,
        3,
        [],
    )


def test_put_autoscaling_changes_what_it_names_and_replaces_the_schedule(
    admin_client: APIClient, pool: Pool
) -> None:
    PoolSchedule.objects.create(
        pool=pool, weekdays=[5], start_minute=0, end_minute=60, min_replicas=2
    )
    response = admin_client.put(
        URL,
        {
            "max_replicas": 12,
            "warm_floor": 2,
            "target_utilisation": 0.6,
            "schedule": [WEEKDAY_MORNINGS],
        },
        format="json",
    )

    assert response.status_code == 200, response.content
    data = response.json()
    assert (data["max_replicas"], data["warm_floor"]) == (12, 2)
    assert data["target_utilisation"] == 0.6
    assert data["scale_down_utilisation"] == 0.5  # not sent: kept
    assert data["schedule"] == [{**WEEKDAY_MORNINGS, "weekdays": [0, 1, 2, 3, 4]}]
    stored = Pool.objects.get(pk=pool.pk)
    assert (stored.max_replicas, stored.target_utilisation) == (12, 0.6)
    # The autoscaler's own columns are left alone.
    assert stored.desired_replicas == 3
    assert stored.autoscaler_state == {"state": {"samples": [[1.0, 5, 0]]}}
    assert list(stored.schedule.values_list("min_replicas", flat=True)) == [6]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"min_replicas": 11}, "min_replicas"),
        ({"scale_down_utilisation": 0.8}, "scale_down_utilisation"),
        ({"panic_window_s": 90.0}, "panic_window_s"),
        ({"warm_floor": 11}, "warm_floor"),
        ({"target_utilisation": 1.0}, "target_utilisation"),
        ({"target_utilisation": 0}, "target_utilisation"),
        ({"target_utilisation": "0.7"}, "target_utilisation"),
        ({"stable_window_s": -1.0}, "stable_window_s"),
        ({"panic_factor": 1.0}, "panic_factor"),
        ({"scale_down_interval_s": -5}, "scale_down_interval_s"),
        ({"max_replicas": 10**6}, "max_replicas"),
        (
            {"schedule": [WEEKDAY_MORNINGS, {**WEEKDAY_MORNINGS, "min_replicas": 8}]},
            "schedule",
        ),
        ({"schedule": [{**WEEKDAY_MORNINGS, "min_replicas": 11}]}, "schedule"),
        (
            {"schedule": [{**WEEKDAY_MORNINGS, "end_minute": 500}]},
            "schedule.0.end_minute",
        ),
        (
            {"schedule": [{**WEEKDAY_MORNINGS, "weekdays": [7]}]},
            "schedule.0.weekdays.0",
        ),
        ({"schedule": [{**WEEKDAY_MORNINGS, "weekdays": []}]}, "schedule.0.weekdays"),
        (
            {"schedule": [{**WEEKDAY_MORNINGS, "start_minute": None}]},
            "schedule.0.start_minute",
        ),
    ],
)
def test_put_autoscaling_refuses_settings_that_make_no_sense(
    admin_client: APIClient, pool: Pool, body: dict[str, Any], param: str
) -> None:
    before = autoscaling.autoscaling_dict(pool)
    response = admin_client.put(URL, body, format="json")

    assert response.status_code == 400, response.content
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    stored = Pool.objects.get(pk=pool.pk)
    assert (stored.min_replicas, stored.target_utilisation) == (1, 0.7)
    assert autoscaling.autoscaling_dict(stored) == before  # nothing was saved


def test_autoscaling_of_an_unknown_pool_or_malformed_names(
    admin_client: APIClient, pool: Pool
) -> None:
    missing = admin_client.get("/admin/pools/chat-7b/v1/us/autoscaling")
    assert missing.status_code == 404 and error_of(missing)["param"] == "region"
    no_model = admin_client.get("/admin/pools/nope/v1/eu/autoscaling")
    assert no_model.status_code == 404 and error_of(no_model)["param"] == "model"
    bad_version = admin_client.put(
        "/admin/pools/chat-7b/1/eu/autoscaling", {}, format="json"
    )
    assert (
        bad_version.status_code == 400 and error_of(bad_version)["param"] == "version"
    )
    bad_region = admin_client.get("/admin/pools/chat-7b/v1/EU/autoscaling")
    assert bad_region.status_code == 400 and error_of(bad_region)["param"] == "region"


def test_autoscaling_endpoint_takes_admin_tokens_only(
    anon_client: APIClient, pool: Pool, team_secret: str
) -> None:
    assert anon_client.put(URL, {}, format="json").status_code == 401
    anon_client.credentials(HTTP_AUTHORIZATION=f"Bearer {team_secret}")
    assert anon_client.put(URL, {"min_replicas": 2}, format="json").status_code == 403
    assert Pool.objects.get(pk=pool.pk).min_replicas == 1


def test_schema_documents_the_autoscaling_endpoint(admin_client: APIClient) -> None:
    schema = admin_client.get("/admin/schema").json()
    operations = schema["paths"]["/admin/pools/{model}/{version}/{region}/autoscaling"]
    assert set(operations) == {"get", "put"}
    parameters = {p["name"]: p["schema"] for p in operations["put"]["parameters"]}
    assert parameters["version"]["pattern"] == "^v[1-9][0-9]{0,8}$"
    assert parameters["region"]["pattern"] == "^[a-z0-9][a-z0-9._-]{0,63}$"
    body = schema["components"]["schemas"]["Autoscaling"]["properties"]
    assert body["target_utilisation"]["exclusiveMaximum"] == 1.0
    assert body["target_utilisation"]["exclusiveMinimum"] == 0.0
    assert body["schedule"]["maxItems"] == 50


def tick(pool: Pool, at: datetime, *, tokens: int) -> None:
    from engine_nodes.models import Replica

    Replica.objects.update(last_heartbeat=at, tokens_in_flight=tokens)
    autoscaling.autoscale_region(
        region=pool.region,
        now=at,
        free_gpus=lambda region, *, now, gpus_per_replica: 10**6,
    )


def test_pool_state_shows_what_the_autoscaler_sees_and_did(
    admin_client: APIClient, pool: Pool, settings: Settings
) -> None:
    settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT = 100_000
    for _ in range(3):
        ReplicaFactory(version=pool.version, region="eu", last_heartbeat=T0)
    ReplicaFactory(
        version=pool.version, region="eu", state="loading", last_heartbeat=T0
    )
    tick(pool, T0, tokens=90_000)  # 270,000 over 4 x 70,000: 4 wanted, 4 there
    tick(pool, T0 + timedelta(seconds=5), tokens=120_000)  # 5 wanted

    with time_machine.travel(T0 + timedelta(seconds=6), tick=False):
        data = admin_client.get("/admin/pools/chat-7b/state").json()

    [entry] = data["pools"]
    assert set(entry) == set(PoolSerializer().fields)
    assert (entry["desired_replicas"], entry["serving_replicas"]) == (5, 3)
    assert entry["starting_replicas"] == 1
    assert (entry["replica_tokens_in_flight"], entry["capacity_is_assumed"]) == (
        100_000,
        True,
    )
    # The short window: (270,000 + 360,000) / 2 over 4 replicas' 400,000.
    assert entry["utilisation"] == pytest.approx(315_000 / 400_000)
    assert entry["autoscaler_tokens_in_flight"] == 360_000
    assert entry["last_reason"] == "utilisation"
    assert not entry["is_capacity_exhausted"] and not entry["is_panicking"]
    assert entry["warnings"] and entry["warnings"][0].startswith("capacity assumed")
    [decision] = entry["decisions"]
    assert set(decision) == set(DecisionSerializer().fields)
    assert (decision["from_replicas"], decision["to_replicas"]) == (3, 5)
    assert entry["autoscaling"]["target_utilisation"] == 0.7


def test_pool_state_has_the_keys_its_typed_dicts_and_serializers_name(
    admin_client: APIClient, pool: Pool
) -> None:
    """``PoolStateOut`` types what ``engine_nodes.services.pool_state`` builds (a
    cast): the JSON, the TypedDicts and the serializers name the same keys."""
    for _ in range(3):
        ReplicaFactory(version=pool.version, region="eu", last_heartbeat=T0)
    PoolSchedule.objects.create(pool=pool, **WEEKDAY_MORNINGS)
    tick(pool, T0, tokens=90_000)
    tick(pool, T0 + timedelta(seconds=5), tokens=120_000)  # decision rows

    with time_machine.travel(T0 + timedelta(seconds=6), tick=False):
        data = admin_client.get("/admin/pools/chat-7b/state").json()

    def keys(typed: Any) -> set[str]:
        required: frozenset[str] = typed.__required_keys__
        return set(required)

    assert set(data) == keys(PoolStateOut) == set(PoolStateSerializer().fields)
    [entry] = data["pools"]
    assert set(entry) == keys(PoolOut) == set(PoolSerializer().fields)
    replica = data["replicas"][0]
    assert set(replica) == keys(ReplicaStateOut) == set(ReplicaStateSerializer().fields)
    decision = entry["decisions"][0]
    assert set(decision) == keys(DecisionOut) == set(DecisionSerializer().fields)
    shown = entry["autoscaling"]
    assert set(shown) == keys(AutoscalingOut) == set(AutoscalingOutSerializer().fields)
    assert set(SCALING_FIELDS) <= keys(AutoscalingOut)
    [rule] = shown["schedule"]
    assert set(rule) == keys(ScheduleRuleOut)


def test_pool_state_queries_do_not_grow_with_pools_and_decisions(
    admin_client: APIClient,
    chat_v1: ModelVersion,
    django_assert_max_num_queries: DjangoAssertNumQueries,
) -> None:
    def add_pool(version: ModelVersion, region: str) -> None:
        pool = Pool.objects.create(
            model=version.model, version=version, region=region, max_replicas=5
        )
        PoolSchedule.objects.create(
            pool=pool, weekdays=[0], start_minute=0, end_minute=60, min_replicas=1
        )
        for n in range(8):
            ScalingDecision.objects.create(
                pool=pool,
                region=region,
                decided_at=T0 + timedelta(seconds=n),
                from_replicas=1,
                to_replicas=2,
                reason="utilisation",
            )

    def count() -> int:
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        with CaptureQueriesContext(connection) as queries:
            assert admin_client.get("/admin/pools/chat-7b/state").status_code == 200
        return len(queries)

    add_pool(chat_v1, "eu")
    few = count()
    v2 = registry_services.register_version(
        model_id="chat-7b", **version_body(weights_hash=digest("v2"))
    )
    add_pool(chat_v1, "us")
    add_pool(v2, "eu")
    with django_assert_max_num_queries(few):
        data = admin_client.get("/admin/pools/chat-7b/state").json()
    assert len(data["pools"]) == 3
    assert all(len(p["decisions"]) == autoscaling.LAST_DECISIONS for p in data["pools"])


def test_metrics_export_the_autoscalers_figures_from_the_database(
    pool: Pool, settings: Settings
) -> None:
    """The worker decides; the process Prometheus scrapes reads the rows."""
    settings.PLATFORM_REGION = "eu"
    settings.PLATFORM_METRICS_TOKEN = "scrape-secret"
    settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT = 110_000
    for _ in range(2):
        ReplicaFactory(version=pool.version, region="eu", last_heartbeat=T0)
    # 400,000 tokens at 70% of an assumed 110,000 per replica: 6 replicas.
    tick(pool, T0, tokens=200_000)

    labels = {"model": "chat-7b", "version": "v1", "region": "eu"}
    with time_machine.travel(T0 + timedelta(seconds=1), tick=False):
        value = REGISTRY.get_sample_value
        assert value("platform_pool_desired_replicas", labels) == 6
        assert value("platform_pool_serving_replicas", labels) == 2
        assert value("platform_pool_capacity_assumed", labels) == 1
        assert value("platform_pool_utilisation", labels) == pytest.approx(
            400_000 / 220_000
        )
        assert (
            value("platform_autoscaler_decisions_total", {**labels, "reason": "panic"})
            == 1
        )
        response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret")
    text = response.content.decode()
    desired = 'platform_pool_desired_replicas{model="chat-7b",region="eu",version="v1"}'
    assert f"{desired} 6.0" in text
    assert "platform_autoscaler_decisions_total" in text


def test_pool_state_reads_a_measured_zero_as_no_measurement_throughout(
    admin_client: APIClient, pool: Pool, settings: Settings
) -> None:
    # Admission and the autoscaler size such a pool on the default; so does the
    # state, and it flags the figure as assumed rather than measured.
    settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT = 100_000
    ModelVersion.objects.filter(pk=pool.version_id).update(
        load_test_tokens_per_s=2_500.0, load_test_tokens_in_flight=0
    )
    for _ in range(2):
        ReplicaFactory(version=pool.version, region="eu", last_heartbeat=T0)
    with time_machine.travel(T0 + timedelta(seconds=1), tick=False):
        [entry] = admin_client.get("/admin/pools/chat-7b/state").json()["pools"]
    assert entry["capacity_tokens_in_flight"] == 2 * 100_000
    assert entry["replica_tokens_in_flight"] == 100_000
    assert (entry["capacity_is_measured"], entry["capacity_is_assumed"]) == (
        False,
        True,
    )


@pytest.mark.parametrize(
    "stored", ["junk", {"last": "x"}, {"last": {"signals": [1, 2]}}, {"state": 3}]
)
def test_pool_state_and_metrics_survive_a_stored_state_of_another_shape(
    admin_client: APIClient, pool: Pool, stored: Any
) -> None:
    Pool.objects.filter(pk=pool.pk).update(autoscaler_state=stored)
    response = admin_client.get("/admin/pools/chat-7b/state")
    assert response.status_code == 200
    [entry] = response.json()["pools"]
    assert entry["last_reason"] is None and entry["autoscaler_queue_depth"] is None
    [figures] = autoscaling.pool_figures(region="eu")
    assert figures.utilisation is None and figures.decisions == {}
