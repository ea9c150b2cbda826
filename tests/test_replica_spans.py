"""The replicas' state history: every way a replica row moves writes its spans, and
the cost model's GPU time is read back from them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import time_machine

from engine_nodes import services
from engine_nodes.models import Replica
from localrun.seeding import digest, version_body
from metering.domain.cost import pool_times
from metering.models import ReplicaSpan
from metering.spans import spans_between
from models_registry import services as registry_services
from models_registry.models import ModelVersion
from tests.factories import ReplicaFactory

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def history(replica_id: str) -> list[tuple[str, datetime, datetime | None]]:
    return list(
        ReplicaSpan.objects.filter(replica_id=replica_id)
        .order_by("started_at", "id")
        .values_list("state", "started_at", "ended_at")
    )


def test_a_replica_life_is_written_span_by_span(chat_v1: ModelVersion) -> None:
    with time_machine.travel(T0, tick=False):
        replica = ReplicaFactory.create(version=chat_v1, state="starting")
    with time_machine.travel(T0 + timedelta(minutes=1), tick=False):
        assert services.set_replica_state(
            replica.replica_id, expected=["starting"], state="loading"
        )
    with time_machine.travel(T0 + timedelta(minutes=2), tick=False):
        services.set_replica_state(
            replica.replica_id, expected=["loading"], state="serving"
        )
        # Not in an expected state: no move, no span.
        assert not services.set_replica_state(
            replica.replica_id, expected=["loading"], state="serving"
        )
    with time_machine.travel(T0 + timedelta(minutes=62), tick=False):
        Replica.objects.filter(pk=replica.pk).update(state="draining")
    with time_machine.travel(T0 + timedelta(minutes=63), tick=False):
        services.remove_replica(replica.replica_id)

    m = timedelta(minutes=1)
    assert history(replica.replica_id) == [
        ("starting", T0, T0 + m),
        ("loading", T0 + m, T0 + 2 * m),
        ("serving", T0 + 2 * m, T0 + 62 * m),
        ("draining", T0 + 62 * m, T0 + 63 * m),
    ]
    (time,) = pool_times(
        spans_between(T0, T0 + timedelta(hours=2)),
        start=T0,
        end=T0 + timedelta(hours=2),
    )
    assert (time.model, time.version) == (chat_v1.model_id, chat_v1.version)
    assert time.held_s == pytest.approx(63 * 60)
    assert time.serving_s == pytest.approx(60 * 60)
    assert time.gpu_s == pytest.approx(63 * 60 * chat_v1.gpus_per_replica)


def test_gone_closes_the_span_and_opens_none(chat_v1: ModelVersion) -> None:
    with time_machine.travel(T0, tick=False):
        replica = ReplicaFactory.create(version=chat_v1, state="serving")
    with time_machine.travel(T0 + timedelta(seconds=30), tick=False):
        Replica.objects.live().filter(pk=replica.pk).update(state="gone")
    assert history(replica.replica_id) == [("serving", T0, T0 + timedelta(seconds=30))]


def test_an_update_that_keeps_the_state_writes_nothing(chat_v1: ModelVersion) -> None:
    with time_machine.travel(T0, tick=False):
        replica = ReplicaFactory.create(version=chat_v1, state="serving")
    with time_machine.travel(T0 + timedelta(seconds=5), tick=False):
        Replica.objects.filter(pk=replica.pk).update(state="serving", queue_depth=3)
        replica.queue_depth = 4
        replica.save()
    assert history(replica.replica_id) == [("serving", T0, None)]


def test_save_with_a_new_state_moves_the_history(chat_v1: ModelVersion) -> None:
    with time_machine.travel(T0, tick=False):
        replica = ReplicaFactory.create(version=chat_v1, state="loading")
    with time_machine.travel(T0 + timedelta(seconds=5), tick=False):
        replica.state = "serving"
        replica.save()
    replica_id = replica.replica_id  # delete() clears the primary key
    with time_machine.travel(T0 + timedelta(seconds=9), tick=False):
        replica.delete()
    s5, s9 = T0 + timedelta(seconds=5), T0 + timedelta(seconds=9)
    assert history(replica_id) == [("loading", T0, s5), ("serving", s5, s9)]


def test_open_spans_count_until_the_end_asked_for(chat_v1: ModelVersion) -> None:
    with time_machine.travel(T0, tick=False):
        ReplicaFactory.create(version=chat_v1, state="serving")
        ReplicaFactory.create(version=chat_v1, state="serving")
    end = T0 + timedelta(minutes=30)
    (time,) = pool_times(spans_between(T0, end), start=T0, end=end)
    assert time.serving_s == pytest.approx(2 * 30 * 60)
    # A window before the replicas existed holds none of their time.
    assert (
        pool_times(
            spans_between(T0 - timedelta(hours=1), T0),
            start=T0 - timedelta(hours=1),
            end=T0,
        )
        == []
    )


def test_a_cascade_from_the_version_ends_the_span(chat_v1: ModelVersion) -> None:
    """Deleting a version deletes its replicas through Django's collector, which
    never calls Replica.delete: the history must still end."""
    v2 = registry_services.register_version(
        model_id=chat_v1.model_id, **version_body(weights_hash=digest("v2"))
    )
    with time_machine.travel(T0, tick=False):
        replica = ReplicaFactory.create(version=v2, state="loading")
    replica_id = replica.replica_id
    with time_machine.travel(T0 + timedelta(seconds=20), tick=False):
        ModelVersion.objects.filter(pk=v2.pk).delete()
    assert not Replica.objects.filter(pk=replica_id).exists()
    assert history(replica_id) == [("loading", T0, T0 + timedelta(seconds=20))]


def test_a_clock_behind_never_ends_a_span_before_it_began(
    chat_v1: ModelVersion,
) -> None:
    """The agent and the reaper read their own clocks; one 2 s behind still moves
    the replica, and its history stays in order."""
    with time_machine.travel(T0, tick=False):
        replica = ReplicaFactory.create(version=chat_v1, state="loading")
    with time_machine.travel(T0 - timedelta(seconds=2), tick=False):
        Replica.objects.filter(pk=replica.pk).update(state="serving")
    assert Replica.objects.get(pk=replica.pk).state == "serving"
    assert history(replica.replica_id) == [("loading", T0, T0), ("serving", T0, None)]


def test_the_history_begins_with_the_replicas_already_live(
    chat_v1: ModelVersion,
) -> None:
    """The migration that starts the history opens a span for each live replica."""
    from importlib import import_module

    from django.apps import apps

    serving = ReplicaFactory.create(version=chat_v1, state="serving")
    gone = ReplicaFactory.create(version=chat_v1, state="gone")
    ReplicaSpan.objects.all().delete()  # as before the history existed
    migration = import_module("metering.migrations.0005_open_spans_of_live_replicas")
    with time_machine.travel(T0, tick=False):
        migration.open_spans(apps, None)
        migration.open_spans(apps, None)  # twice: one open span each, still
    assert history(serving.replica_id) == [("serving", T0, None)]
    assert history(gone.replica_id) == []
