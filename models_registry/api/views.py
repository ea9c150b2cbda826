"""Control-plane endpoints for models, versions, aliases and pool state."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from config.api import validated
from models_registry import services
from models_registry.api.serializers import (
    AliasSerializer,
    ModelCreateSerializer,
    PoolStateSerializer,
    VersionRegisterSerializer,
    VersionSerializer,
)
from models_registry.models import Model


class ModelListView(APIView):
    """List models or register a new model name."""

    @extend_schema(operation_id="models_list", responses={200: dict})
    def get(self, request: Request) -> Response:
        rows = Model.objects.values_list("model", flat=True)
        return Response({"data": [services.model_detail(m) for m in rows]})

    @extend_schema(request=ModelCreateSerializer, responses={201: dict})
    def post(self, request: Request) -> Response:
        body = validated(ModelCreateSerializer, request.data)
        model = services.create_model(
            model_id=body["model"], description=body.get("description", "")
        )
        return Response(
            services.model_detail(model.model), status=status.HTTP_201_CREATED
        )


class ModelDetailView(APIView):
    """A model with its versions, pools and pending rollout."""

    @extend_schema(responses={200: dict})
    def get(self, request: Request, model: str) -> Response:
        return Response(services.model_detail(model))


class VersionListView(APIView):
    """Register a version (seed: POST /admin/models/{model}/versions) or list them."""

    @extend_schema(responses={200: VersionSerializer(many=True)})
    def get(self, request: Request, model: str) -> Response:
        return Response({"data": services.model_detail(model)["versions"]})

    @extend_schema(
        request=VersionRegisterSerializer, responses={201: VersionSerializer}
    )
    def post(self, request: Request, model: str) -> Response:
        body = validated(VersionRegisterSerializer, request.data)
        version = services.register_version(model_id=model, **body)
        return Response(services.version_dict(version), status=status.HTTP_201_CREATED)


class AliasView(APIView):
    """Point a model name at a version (seed: PUT /admin/models/{model}/alias)."""

    @extend_schema(request=AliasSerializer, responses={200: dict})
    def put(self, request: Request, model: str) -> Response:
        body = validated(AliasSerializer, request.data)
        services.set_alias(model_id=model, version=body["version"])
        return Response(services.model_detail(model))


class PoolStateView(APIView):
    """The seed's GET /admin/pools/{model}/state."""

    @extend_schema(
        parameters=[OpenApiParameter("region", str, required=False)],
        responses={200: PoolStateSerializer},
    )
    def get(self, request: Request, model: str) -> Response:
        region = request.query_params.get("region") or None
        return Response(
            services.pool_state(model_id=model, now=timezone.now(), region=region)
        )
