"""reconcile_pools on the database: what it plans and marks, without processes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import count

import pytest
import time_machine
from pytest_django import Settings

from engine_nodes import services
from engine_nodes.models import Replica
from localrun.seeding import VERSION_BODY, version_body
from models_registry import services as registry_services
from models_registry.models import ModelVersion, Pool
from tests.factories import ReplicaFactory, accept

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def pool(chat_v1: ModelVersion, settings: Settings) -> Pool:
    settings.PLATFORM_HEARTBEAT_DB_S = 1.0
    settings.PLATFORM_MISSED_BEATS = 3
    return Pool.objects.create(
        model_id="chat-7b", version=chat_v1, region="eu", min_replicas=1, max_replicas=4
    )


def reconcile(*, gpus_free: int = 8, **kwargs: object) -> tuple[list[str], list[str]]:
    ports = count(9000)
    created, drained = services.reconcile_pools(
        region="eu",
        node="here",
        gpus_free=gpus_free,
        allocate_port=lambda: next(ports),
        host="127.0.0.1",
        now=T0,
        **kwargs,  # type: ignore[arg-type]
    )
    return [r.replica_id for r in created], drained


def add(
    pool: Pool,
    replica_id: str,
    state: str = "serving",
    *,
    created_at: datetime = T0,
    **fields: object,
) -> None:
    with time_machine.travel(created_at, tick=False):
        ReplicaFactory.create(
            replica_id=replica_id,
            version=pool.version,
            region="eu",
            node="elsewhere",
            state=state,
            **{"last_heartbeat": T0, **fields},
        )


def states() -> dict[str, str]:
    return dict(Replica.objects.values_list("replica_id", "state"))


def test_reconcile_marks_one_replica_of_a_shrunk_pool_draining_the_least_loaded(
    pool: Pool,
) -> None:
    add(pool, "busy", tokens_in_flight=9000)
    add(pool, "idle", tokens_in_flight=0)
    add(pool, "some", tokens_in_flight=300)
    assert reconcile() == ([], ["idle"])
    assert reconcile() == ([], [])  # one drain at a time
    assert states() == {"busy": "serving", "idle": "draining", "some": "serving"}


def test_reconcile_counts_starting_replicas_toward_the_target(pool: Pool) -> None:
    Pool.objects.filter(pk=pool.pk).update(desired_replicas=3)
    add(pool, "up")
    add(pool, "coming", "starting", last_heartbeat=None)
    add(pool, "loading", "loading")
    assert reconcile() == ([], [])


def test_reconcile_cancels_unready_replicas_before_draining_serving_ones(
    pool: Pool,
) -> None:
    add(pool, "up")
    add(pool, "coming", "starting", created_at=T0 - timedelta(seconds=1))
    add(pool, "loading", "loading")
    assert sorted(reconcile()[1]) == ["coming", "loading"]
    assert states()["up"] == "serving"


def test_reconcile_keeps_serving_replicas_while_others_are_silent(
    pool: Pool,
) -> None:
    add(pool, "healthy")
    add(pool, "dead", last_heartbeat=T0 - timedelta(seconds=4))
    assert reconcile() == ([], [])
    assert set(states().values()) == {"serving"}


def test_reconcile_starts_no_replica_of_a_version_whose_weights_failed_here(
    pool: Pool,
) -> None:
    assert reconcile(skip_version_ids={pool.version_id}) == ([], [])
    created, _ = reconcile()
    assert len(created) == 1
    assert states() == {created[0]: "starting"}


def test_reconcile_gives_a_kv_events_port_to_replicas_of_versions_that_publish(
    pool: Pool,
) -> None:
    """GIVEN chat-7b@v1 without kv_events and v2 with it, a pool each
    WHEN each pool plans a replica
    THEN only v2's gets a kv_events_url, on a port of its own."""
    body = version_body(
        version="v2",
        engine_config={**VERSION_BODY["engine_config"], "kv_events": True},
    )
    v2 = accept(registry_services.register_version(model_id="chat-7b", **body))
    Pool.objects.create(
        model_id="chat-7b", version=v2, region="eu", min_replicas=1, max_replicas=1
    )
    reconcile()
    rows = {r.version_id: r for r in Replica.objects.all()}
    assert rows[pool.version_id].kv_events_url == ""
    replica = rows[v2.pk]
    host_port = replica.url.removeprefix("http://")
    kv_host, kv_port = replica.kv_events_url.removeprefix("tcp://").rsplit(":", 1)
    assert kv_host == "127.0.0.1"
    assert int(kv_port) not in {int(r.url.rsplit(":", 1)[1]) for r in rows.values()}
    assert host_port.startswith("127.0.0.1:")
    spec = services.replica_spec(
        v2,
        model_id="chat-7b",
        replica_id=replica.replica_id,
        weights_dir="",
        host="127.0.0.1",
        port=int(host_port.rsplit(":", 1)[1]),
        kv_events_port=int(kv_port),
    )
    assert spec.kv_events_port == int(kv_port)
