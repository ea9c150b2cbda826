"""Control-plane endpoints of pools: their live state, and their autoscaling settings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from audit.api.base import AuditedView
from config.api import ControlPlaneView, ErrorSerializer, openapi_pattern, validated
from config.errors import InvalidRequest
from config.names import SLUG_PATTERN, SLUG_RULE, is_valid_slug
from control import autoscaling
from control.api.serializers import (
    AutoscalingOutSerializer,
    AutoscalingSerializer,
    PoolStateSerializer,
    PoolTrafficOutSerializer,
    PoolTrafficSerializer,
)
from models_registry import pool_traffic
from models_registry.models import Pool, PoolSchedule
from models_registry.pools import get_pool


class PoolStateView(ControlPlaneView):
    """The seed's GET /admin/pools/{model}/state: per pool and region its live
    figures (the gateways', rollout or not) and what the autoscaler sees."""

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "region",
                str,
                required=False,
                description=(
                    f"Only this region's pools, replicas and hit rate: {SLUG_RULE}. "
                    "A malformed region is a 400."
                ),
                pattern=openapi_pattern(SLUG_PATTERN),
            )
        ],
        responses={200: PoolStateSerializer, 400: ErrorSerializer},
    )
    def get(self, request: Request, model: str) -> Response:
        region = request.query_params.get("region")
        if region is not None and not is_valid_slug(region):
            raise InvalidRequest(f"region must be {SLUG_RULE}", param="region")
        return Response(
            autoscaling.pool_state(model_id=model, now=timezone.now(), region=region)
        )


class PoolAutoscalingView(AuditedView):
    """Read or change a pool's autoscaling settings and schedule.

    GET /admin/pools/{model}/{version}/{region}/autoscaling, and PUT with the fields
    to change (the others keep their values; ``schedule`` replaces the rows).
    """

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        pool = {
            "model_id": kwargs["model"],
            "version__version": kwargs["version"],
            "region": kwargs["region"],
        }
        return [
            Pool.objects.filter(**pool),
            PoolSchedule.objects.filter(**{f"pool__{k}": v for k, v in pool.items()}),
        ]

    @extend_schema(responses={200: AutoscalingOutSerializer})
    def get(self, request: Request, model: str, version: str, region: str) -> Response:
        pool = get_pool(model_id=model, version=version, region=region)
        return Response(autoscaling.autoscaling_dict(pool))

    @extend_schema(
        request=AutoscalingSerializer, responses={200: AutoscalingOutSerializer}
    )
    def put(self, request: Request, model: str, version: str, region: str) -> Response:
        body = validated(AutoscalingSerializer, request.data)
        pool = autoscaling.set_pool_autoscaling(
            model_id=model, version=version, region=region, changes=body
        )
        return Response(autoscaling.autoscaling_dict(pool))


class PoolTrafficView(AuditedView):
    """Read or change the share of a pool's conversations the gateways record for
    the traffic twin: GET and PUT /admin/pools/{model}/{version}/{region}/traffic."""

    def audit_scope(self, request: Request, **kwargs: Any) -> Sequence[QuerySet[Any]]:
        return [
            Pool.objects.filter(
                model_id=kwargs["model"],
                version__version=kwargs["version"],
                region=kwargs["region"],
            )
        ]

    @extend_schema(responses={200: PoolTrafficOutSerializer, 404: ErrorSerializer})
    def get(self, request: Request, model: str, version: str, region: str) -> Response:
        return Response(
            pool_traffic.pool_traffic(model_id=model, version=version, region=region)
        )

    @extend_schema(
        request=PoolTrafficSerializer,
        responses={
            200: PoolTrafficOutSerializer,
            400: ErrorSerializer,
            404: ErrorSerializer,
        },
    )
    def put(self, request: Request, model: str, version: str, region: str) -> Response:
        body = validated(PoolTrafficSerializer, request.data)
        return Response(
            pool_traffic.set_pool_traffic(
                model_id=model,
                version=version,
                region=region,
                share=body["record_traffic_share"],
            )
        )
