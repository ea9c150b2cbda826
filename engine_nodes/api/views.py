"""Control-plane endpoint for a pool's live state (its replicas, load and hit rate)."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.domain.names import SLUG_PATTERN, SLUG_RULE, is_valid_slug
from config.api import ControlPlaneView, openapi_pattern
from config.errors import InvalidRequest
from engine_nodes import services
from engine_nodes.api.serializers import PoolStateSerializer


class PoolStateView(ControlPlaneView):
    """The seed's GET /admin/pools/{model}/state."""

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "region",
                str,
                required=False,
                description=f"Only this region's pools: {SLUG_RULE}.",
                pattern=openapi_pattern(SLUG_PATTERN),
            )
        ],
        responses={200: PoolStateSerializer},
    )
    def get(self, request: Request, model: str) -> Response:
        region = request.query_params.get("region")
        if region is not None and not is_valid_slug(region):
            raise InvalidRequest(f"region must be {SLUG_RULE}", param="region")
        return Response(
            services.pool_state(model_id=model, now=timezone.now(), region=region)
        )
