"""Open rollouts and guard trips at /metrics, read from real rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY

from models_registry import services as registry_services
from models_registry.models import ModelVersion
from rollouts.domain.plan import Decision, GuardAction
from rollouts.models import GuardEvaluation, Rollout
from tests.factories import accept, digest, version_body

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def rollout(version: ModelVersion, *, decision: Decision, **fields: object) -> Rollout:
    values: dict[str, object] = {"stage": "canary", "percent": 5.0, "started_at": T0}
    values.update(fields)
    return Rollout.objects.create(
        model=version.model, version=version, decision=decision.value, **values
    )


def evaluate(r: Rollout, action: GuardAction, at: datetime) -> None:
    GuardEvaluation.objects.create(
        rollout=r,
        at=at,
        step=0,
        stage=r.stage,
        percent=r.percent,
        action=action.value,
        reason="a test's",
    )


@pytest.fixture
def chat_v2(chat_v1: ModelVersion) -> ModelVersion:
    version = registry_services.register_version(
        model_id="chat-7b", **version_body(weights_hash=digest("weights v2"))
    )
    return accept(version)


def test_open_rollouts_and_guard_trips(
    chat_v1: ModelVersion, chat_v2: ModelVersion
) -> None:
    tripped = rollout(chat_v1, decision=Decision.ROLLED_BACK, stage="shadow", percent=1)
    evaluate(tripped, GuardAction.CONTINUE, T0)
    evaluate(tripped, GuardAction.ROLL_BACK, T0 + timedelta(minutes=1))
    evaluate(tripped, GuardAction.ROLL_BACK, T0 + timedelta(minutes=3))
    running = rollout(chat_v2, decision=Decision.PENDING, paused=True)
    evaluate(running, GuardAction.ADVANCE, T0 + timedelta(minutes=5))

    value = REGISTRY.get_sample_value
    open_v2 = {"model": "chat-7b", "version": "v2", "stage": "canary"}
    assert value("platform_rollout_open", open_v2) == 1
    assert value("platform_rollout_percent", open_v2) == 5.0
    assert value("platform_rollout_paused", open_v2) == 1
    assert value("platform_rollout_open", {**open_v2, "version": "v1"}) is None

    v1 = {"model": "chat-7b", "version": "v1"}
    v2 = {"model": "chat-7b", "version": "v2"}
    assert value("platform_rollout_guard_trips_total", v1) == 2
    last = (T0 + timedelta(minutes=3)).timestamp()
    assert value("platform_rollout_guard_last_trip_timestamp_seconds", v1) == last
    # A version that never tripped is counted at 0, with no last trip.
    assert value("platform_rollout_guard_trips_total", v2) == 0
    assert value("platform_rollout_guard_last_trip_timestamp_seconds", v2) is None
