"""Batches running and at risk at /metrics, read from real rows."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client import REGISTRY

from accounts.models import Team
from batches.models import Batch
from models_registry.models import ModelVersion

pytestmark = pytest.mark.django_db


def batch(team: Team, version: ModelVersion, status: str, *, at_risk: bool) -> None:
    now = timezone.now()
    Batch.objects.create(
        id=f"batch_{uuid.uuid4().hex}",
        team=team,
        model=version.model,
        completion_window="1h",
        status=status,
        at_risk=at_risk,
        created_at=now,
        deadline_at=now + timedelta(hours=1),
    )


def test_batches_at_risk_count_those_in_progress(
    team: Team, chat_v1: ModelVersion
) -> None:
    batch(team, chat_v1, Batch.Status.IN_PROGRESS, at_risk=True)
    batch(team, chat_v1, Batch.Status.IN_PROGRESS, at_risk=False)
    batch(team, chat_v1, Batch.Status.VALIDATING, at_risk=False)
    # The flag of a batch past its lines, or ended, is stale: not at risk now.
    batch(team, chat_v1, Batch.Status.FINALIZING, at_risk=True)
    batch(team, chat_v1, Batch.Status.COMPLETED, at_risk=True)
    batch(team, chat_v1, Batch.Status.EXPIRED, at_risk=True)

    value = REGISTRY.get_sample_value
    assert value("platform_batches_active", {"model": "chat-7b"}) == 4
    assert value("platform_batches_at_risk", {"model": "chat-7b"}) == 1


def test_a_model_without_running_batches_has_no_series(
    team: Team, chat_v1: ModelVersion
) -> None:
    batch(team, chat_v1, Batch.Status.COMPLETED, at_risk=False)
    assert (
        REGISTRY.get_sample_value("platform_batches_active", {"model": "chat-7b"})
        is None
    )
