"""Control-plane endpoint for a model's versions.

The model endpoints themselves (list, detail, alias) show where traffic goes, so
they live in ``rollouts.api.views``; a pool's live state is ``engine_nodes.api``.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from config.api import ControlPlaneView, ErrorSerializer, validated
from models_registry import services
from models_registry.api.serializers import VersionRegisterSerializer, VersionSerializer


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
