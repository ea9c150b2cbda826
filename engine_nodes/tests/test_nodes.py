"""The node registry: node beats, and the GPUs a region has free for the autoscaler."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pytest_django import Settings

from engine_nodes import services
from engine_nodes.models import Node
from models_registry import services as registry
from models_registry.models import ModelVersion
from tests.factories import ReplicaFactory, digest, version_body

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(autouse=True)
def beats(settings: Settings) -> None:
    settings.PLATFORM_HEARTBEAT_DB_S = 1.0
    settings.PLATFORM_MISSED_BEATS = 3


@pytest.fixture
def chat_v2(chat_v1: ModelVersion) -> ModelVersion:
    """A 2-GPU version of chat-7b."""
    return registry.register_version(
        model_id="chat-7b",
        **version_body(
            version="v2", weights_hash=digest("two gpus"), gpus_per_replica=2
        ),
    )


def test_free_gpus_is_zero_in_a_region_with_no_node(chat_v1: ModelVersion) -> None:
    assert services.free_gpus("eu", now=T0) == 0


def test_free_gpus_is_the_live_nodes_gpus_less_their_replicas(
    chat_v1: ModelVersion, chat_v2: ModelVersion
) -> None:
    services.record_node_beat(node="a", region="eu", gpus=8, now=T0)
    services.record_node_beat(node="b", region="eu", gpus=4, now=T0)
    # Every state but gone holds its GPUs: starting, loading, serving, draining.
    for state in ("starting", "loading", "serving", "stalled", "draining"):
        ReplicaFactory.create(version=chat_v1, region="eu", node="a", state=state)
    ReplicaFactory.create(version=chat_v1, region="eu", node="a", state="gone")
    ReplicaFactory.create(version=chat_v2, region="eu", node="b")
    assert services.free_gpus("eu", now=T0) == (8 - 5) + (4 - 2)


def test_free_gpus_ignores_silent_nodes_other_regions_and_overfull_nodes(
    chat_v1: ModelVersion,
) -> None:
    services.record_node_beat(node="fresh", region="eu", gpus=2, now=T0)
    services.record_node_beat(
        node="silent", region="eu", gpus=8, now=T0 - timedelta(seconds=3.5)
    )
    services.record_node_beat(node="elsewhere", region="us", gpus=8, now=T0)
    services.record_node_beat(node="full", region="eu", gpus=1, now=T0)
    for _ in range(3):
        # More replicas than GPUs (the node was restarted with fewer): not -2.
        ReplicaFactory.create(version=chat_v1, region="eu", node="full")
    assert services.free_gpus("eu", now=T0) == 2
    # Within three missed beats the silent node still counts.
    assert services.free_gpus("eu", now=T0 - timedelta(seconds=1)) == 10


def test_free_gpus_for_wide_replicas_counts_whole_replicas_per_node(
    chat_v1: ModelVersion,
) -> None:
    services.record_node_beat(node="a", region="eu", gpus=3, now=T0)
    services.record_node_beat(node="b", region="eu", gpus=1, now=T0)
    assert services.free_gpus("eu", now=T0) == 4
    # A 2-GPU replica fits once on a, never across a and b.
    assert services.free_gpus("eu", now=T0, gpus_per_replica=2) == 2
    with pytest.raises(ValueError, match="gpus_per_replica"):
        services.free_gpus("eu", now=T0, gpus_per_replica=0)


def test_free_gpus_drops_a_node_that_shut_down(chat_v1: ModelVersion) -> None:
    services.record_node_beat(node="a", region="eu", gpus=4, now=T0)
    services.forget_node(node="a", region="eu")
    assert services.free_gpus("eu", now=T0) == 0


def test_record_node_beat_updates_the_row_and_warm_versions_only_when_given(
    chat_v1: ModelVersion, chat_v2: ModelVersion
) -> None:
    services.record_node_beat(
        node="a", region="eu", gpus=4, now=T0, warm_version_ids=[chat_v1.pk]
    )
    later = T0 + timedelta(seconds=1)
    services.record_node_beat(node="a", region="eu", gpus=8, now=later)
    node = Node.objects.get()
    assert (node.gpus, node.last_beat) == (8, later)
    assert list(node.warm_versions.all()) == [chat_v1]
    services.record_node_beat(
        node="a",
        region="eu",
        gpus=8,
        now=later,
        # A version deleted meanwhile (id 10**9) is skipped, not an error.
        warm_version_ids=[chat_v2.pk, 10**9],
    )
    assert list(Node.objects.get().warm_versions.all()) == [chat_v2]
    assert list(chat_v2.warm_nodes.all()) == [node]
