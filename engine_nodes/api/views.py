"""Control-plane endpoint for a pool's live state (its replicas, load and hit rate)."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from engine_nodes import services
from engine_nodes.api.serializers import PoolStateSerializer


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
