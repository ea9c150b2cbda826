"""Control-plane endpoints for a model's versions and their gates.

The model endpoints themselves (list, detail, alias) show where traffic goes, so
they live in ``rollouts.api.views``; a pool's live state is ``control.api``.
"""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from config.api import ControlPlaneView, ErrorSerializer, admin_name, validated
from models_registry import services
from models_registry.api.serializers import (
    GateConfigSerializer,
    GateHistorySerializer,
    VersionRegisterSerializer,
    VersionSerializer,
)


class VersionListView(ControlPlaneView):
    """Register a version (seed: POST /admin/models/{model}/versions) or list them."""

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


class VersionGatesView(ControlPlaneView):
    """A version's gates: every attempt (GET), or run them again (POST, 202)."""

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


class GateConfigView(ControlPlaneView):
    """A model's gate settings: eval set, judge, thresholds, load-test steps."""

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
