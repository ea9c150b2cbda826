"""Control-plane endpoints for a model's versions and their gates.

The model endpoints themselves (list, detail, alias) show where traffic goes, so
they live in ``rollouts.api.views``; a pool's live state is ``control.api``.
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

from audit.api.base import AuditedView
from config.api import ErrorSerializer, admin_name, validated
from models_registry import services
from models_registry.api.serializers import (
    GateConfigSerializer,
    GateHistorySerializer,
    VersionRegisterSerializer,
    VersionSerializer,
)
from models_registry.models import Model, ModelVersion, Pool


class VersionListView(AuditedView):
    """Register a version (seed: POST /admin/models/{model}/versions) or list them."""

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        model = kwargs["model"]
        return [
            ModelVersion.objects.filter(model_id=model),
            Pool.objects.filter(model_id=model),
        ]

    @extend_schema(
        responses={
            200: inline_serializer(
                "VersionList", {"data": VersionSerializer(many=True)}
            )
        }
    )
    def get(self, request: Request, model: str) -> Response:
        found = services.get_model(model)
        return Response({"data": services.model_dict(found)["versions"]})

    @extend_schema(
        request=VersionRegisterSerializer,
        # 409: the identity or the label is registered already.
        responses={201: VersionSerializer, 409: ErrorSerializer},
    )
    def post(self, request: Request, model: str) -> Response:
        body = validated(VersionRegisterSerializer, request.data)
        version = services.register_version(model_id=model, **body)
        return Response(services.version_dict(version), status=status.HTTP_201_CREATED)


class VersionGatesView(AuditedView):
    """A version's gates: every attempt (GET), or run them again (POST, 202)."""

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        return [
            ModelVersion.objects.filter(
                model_id=kwargs["model"], version=kwargs["version"]
            )
        ]

    @extend_schema(responses={200: GateHistorySerializer})
    def get(self, request: Request, model: str, version: str) -> Response:
        return Response(services.gate_history(model, version))

    @extend_schema(
        request=None,
        # 409: the gates are running, or the version is live or retired.
        responses={202: GateHistorySerializer, 409: ErrorSerializer},
    )
    def post(self, request: Request, model: str, version: str) -> Response:
        found = services.get_version(model, version)
        services.start_gates(
            found, requested_by=admin_name(request), now=timezone.now()
        )
        return Response(
            services.gate_history(model, version), status=status.HTTP_202_ACCEPTED
        )


class GateConfigView(AuditedView):
    """A model's gate settings: eval set, judge, thresholds, load-test steps."""

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        return [Model.objects.filter(pk=kwargs["model"])]

    @extend_schema(responses={200: GateConfigSerializer})
    def get(self, request: Request, model: str) -> Response:
        found = services.get_model(model)
        return Response(services.gate_config(found).as_dict())

    @extend_schema(
        request=GateConfigSerializer,
        responses={200: GateConfigSerializer, 400: ErrorSerializer},
    )
    def put(self, request: Request, model: str) -> Response:
        if not isinstance(request.data, dict):
            validated(GateConfigSerializer, request.data)  # the shape's own 400
        found = services.set_gate_config(model_id=model, raw=request.data)
        return Response(services.gate_config(found).as_dict())
