"""The rows a change of where a model's traffic goes may touch, for the audit trail
(``audit.services.Capture``): the REST alias and rollout views and the console's
rollout controls read them before and after.

Public surface: ``traffic_scope``.
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from models_registry.models import Model, ModelVersion
from rollouts.models import Rollout, VersionOverride

__all__ = ["traffic_scope"]


def traffic_scope(model: str) -> list[QuerySet[Any]]:
    """Return the model's row (alias, canary, plan), its versions (their status),
    its rollouts and its overrides."""
    return [
        Model.objects.filter(pk=model),
        ModelVersion.objects.filter(model_id=model),
        Rollout.objects.filter(model_id=model),
        VersionOverride.objects.filter(model_id=model),
    ]
