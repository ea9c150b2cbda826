"""A node agent's pass and a rollout's step, each in its own connection, both
finish: the locks one takes never wait on the other's.

What deadlocked in CI: the pass locked its region's pools (and, through the
join, their versions) then inserted a replica naming the model; the step locked
the model then pointed its canary at a version. Each insert's foreign-key check
waited on the other's lock. PostgreSQL's row locks are what is tested: the
test skips on another database.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from django.db import connection, transaction

from engine_nodes.models import Replica, ReplicaState
from engine_nodes.services import lock_region_pools
from models_registry import services as registry
from models_registry.models import Model, ModelVersion, Pool
from tests.factories import accept, digest, version_body

pytestmark = [pytest.mark.django_db(transaction=True)]

# Each waits this long for a lock at most, so a lock that waits fails the test
# in seconds (PostgreSQL's deadlock check, one second, usually fails it first).
LOCK_TIMEOUT = "5s"
DEADLINE_S = 30.0


def _in_transaction(
    first: Callable[[], object],
    second: Callable[[], object],
    both_hold: threading.Barrier,
    errors: list[BaseException],
) -> None:
    """Run ``first`` then, once the other thread's first step holds its locks
    too, ``second``, in one transaction of this thread's own connection."""
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            first()
            both_hold.wait(timeout=DEADLINE_S)
            second()
    except BaseException as error:  # handed to the test's thread
        errors.append(error)
        both_hold.abort()
    finally:
        connection.close()


def test_an_agent_pass_and_a_rollout_step_do_not_deadlock(
    postgres: None, chat_v1: ModelVersion
) -> None:
    """GIVEN chat-7b@v1 live and v2 ready, each with a pool in region 'test'
    WHEN an agent's pass holds the region's pool locks and a rollout's step holds
    the model's, and then the pass inserts a replica of v2 while the step points
    the model's canary at v2
    THEN both commit: the replica exists and v2 is the canary."""
    v2 = accept(
        registry.register_version(
            model_id="chat-7b", **version_body(version="v2", weights_hash=digest("v2"))
        )
    )
    for version in (chat_v1, v2):
        Pool.objects.create(
            model_id="chat-7b", version=version, region="test", max_replicas=4
        )
    both_hold = threading.Barrier(2)
    errors: list[BaseException] = []

    locked: dict[str, object] = {}

    def lock_pools() -> None:
        locked_versions = [p.version_id for p in lock_region_pools("test")]
        assert locked_versions == [chat_v1.pk, v2.pk]

    def insert_replica() -> None:
        Replica.objects.create(
            replica_id="chat-7b-v2-test-node-1",
            model_id="chat-7b",
            version=v2,
            region="test",
            node="node",
            state=ReplicaState.STARTING,
        )

    def lock_model() -> None:
        locked["model"] = registry.get_model("chat-7b", for_update=True)

    def point_canary() -> None:
        model = locked["model"]
        assert isinstance(model, Model)
        model.canary_version = v2
        model.canary_percent = 10.0
        model.save(update_fields=["canary_version", "canary_percent", "updated_at"])

    agent = threading.Thread(
        target=_in_transaction, args=(lock_pools, insert_replica, both_hold, errors)
    )
    step = threading.Thread(
        target=_in_transaction, args=(lock_model, point_canary, both_hold, errors)
    )
    agent.start()
    step.start()
    agent.join(DEADLINE_S)
    step.join(DEADLINE_S)

    assert not agent.is_alive() and not step.is_alive(), "a transaction hangs"
    assert errors == []
    assert Replica.objects.filter(pk="chat-7b-v2-test-node-1").exists()
    assert registry.get_model("chat-7b").canary_version_id == v2.pk
