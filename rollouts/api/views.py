"""Control-plane endpoints for where a model's traffic goes.

A model is shown with its alias, canary and pending rollout, so the model endpoints
(list, create, detail) live here with the alias and the rollout, on top of the
registry; the registry's own endpoint is a model's versions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from audit.api.base import AuditedView, body_text
from config.api import ControlPlaneView, ErrorSerializer, admin_name, validated
from config.errors import InvalidRequest
from models_registry import services as registry
from models_registry.api.serializers import ModelCreateSerializer
from models_registry.models import Model
from rollouts import plans, services
from rollouts.api.serializers import (
    AliasSerializer,
    ModelDetailSerializer,
    RolloutOutSerializer,
    RolloutPlanSerializer,
    RolloutSerializer,
    RolloutStateSerializer,
)
from rollouts.domain.plan import Decision
from rollouts.models import Rollout
from rollouts.traffic_scope import traffic_scope


class ModelListView(AuditedView):
    """List models or register a new model name."""

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        # Only the model the body names: a registration touches no other.
        return [Model.objects.filter(pk=body_text(request, "model"))]

    @extend_schema(
        operation_id="models_list",
        responses={
            200: inline_serializer(
                "ModelList", {"data": ModelDetailSerializer(many=True)}
            )
        },
    )
    def get(self, request: Request) -> Response:
        rows = Model.objects.values_list("model", flat=True)
        return Response({"data": [services.model_detail(m) for m in rows]})

    @extend_schema(
        request=ModelCreateSerializer,
        responses={201: ModelDetailSerializer, 409: ErrorSerializer},
    )
    def post(self, request: Request) -> Response:
        body = validated(ModelCreateSerializer, request.data)
        model = registry.create_model(
            model_id=body["model"],
            description=body.get("description", ""),
            kind=body["kind"],
            dimensions=body.get("dimensions"),
            max_input_tokens=body.get("max_input_tokens"),
        )
        return Response(
            services.model_detail(model.model), status=status.HTTP_201_CREATED
        )


class ModelDetailView(ControlPlaneView):
    """A model with its versions, pools and pending rollout."""

    @extend_schema(responses={200: ModelDetailSerializer})
    def get(self, request: Request, model: str) -> Response:
        return Response(services.model_detail(model))


class AliasView(AuditedView):
    """Point a model name at a version (seed: PUT /admin/models/{model}/alias)."""

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        return traffic_scope(kwargs["model"])

    @extend_schema(
        request=AliasSerializer,
        # 409: the version is not ready (its gates have not passed) or retired.
        responses={200: ModelDetailSerializer, 409: ErrorSerializer},
    )
    def put(self, request: Request, model: str) -> Response:
        body = validated(AliasSerializer, request.data)
        services.set_alias(
            model_id=model,
            version=body["version"],
            override=_override(request, body.pop("override", None)),
        )
        return Response(services.model_detail(model))


class RolloutView(AuditedView):
    """Read the rollout, or set one (seed: PUT /admin/models/{model}/rollout).

    PUT takes a stage set by hand, a plan that runs itself, or an action on the
    running rollout (``RolloutSerializer``).
    """

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        return traffic_scope(kwargs["model"])

    @extend_schema(responses={200: RolloutStateSerializer})
    def get(self, request: Request, model: str) -> Response:
        found = registry.get_model(model)
        rows = list(
            Rollout.objects.filter(model_id=model).select_related(
                "version", "previous_version"
            )[:50]
        )
        pending = next((r for r in rows if r.decision == Decision.PENDING), None)
        newest = pending or (rows[0] if rows else None)
        return Response(
            {
                "pending": services.rollout_dict(pending) if pending else None,
                "history": [services.rollout_dict(r) for r in rows],
                "plan": plans.model_plan(found).to_json(),
                "evaluations": plans.evaluations(newest) if newest else [],
            }
        )

    @extend_schema(
        request=RolloutSerializer,
        # 404: an action with no rollout running. 409: the version is live
        # already, not ready (its gates have not passed) or retired; or an action
        # a stage set by hand cannot take.
        responses={
            200: RolloutOutSerializer,
            404: ErrorSerializer,
            409: ErrorSerializer,
        },
    )
    def put(self, request: Request, model: str) -> Response:
        body = validated(RolloutSerializer, request.data)
        now = timezone.now()
        if "action" in body:
            rollout = plans.control(
                model, body["action"], by=admin_name(request), now=now
            )
        elif "plan" in body:
            rollout = plans.start_plan(
                model_id=model,
                version=body["version"],
                now=now,
                plan=body["plan"],
                override=_override(request, body.get("override")),
            )
        else:
            override = _override(request, body.pop("override", None))
            rollout = services.set_rollout(
                model_id=model,
                now=now,
                override=override,
                version=body["version"],
                stage=body["stage"],
                percent=body["percent"],
            )
        rollout = Rollout.objects.select_related("version", "previous_version").get(
            pk=rollout.pk
        )
        return Response(services.rollout_dict(rollout))


class RolloutPlanView(AuditedView):
    """A model's rollout plan: its steps and minimums, retention, guard thresholds."""

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        return traffic_scope(kwargs["model"])

    @extend_schema(responses={200: RolloutPlanSerializer})
    def get(self, request: Request, model: str) -> Response:
        return Response(plans.model_plan(registry.get_model(model)).to_json())

    @extend_schema(
        request=RolloutPlanSerializer,
        responses={200: RolloutPlanSerializer, 400: ErrorSerializer},
    )
    def put(self, request: Request, model: str) -> Response:
        data = request.data
        if not isinstance(data, dict):
            raise InvalidRequest("a rollout plan is a JSON object", param="plan")
        registry.get_model(model)
        return Response(plans.set_model_plan(model, data).to_json())


def _override(
    request: Request, body: dict[str, Any] | None
) -> services.Override | None:
    """Return the body's override, made by the admin token that sent it."""
    if body is None:
        return None
    return services.Override(by=admin_name(request), reason=body["reason"])
