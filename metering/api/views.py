"""Usage and cost reports over HTTP.

- ``GET /admin/reports/usage``: every team's usage and cost per day or month, JSON
  or CSV (``format=csv``), for an admin token or a reports token (finance's).
- ``GET /v1/organization/usage/completions`` and ``GET /v1/organization/costs``: a
  team's own usage and cost with its API key, in the shapes of OpenAI's
  organization usage and costs APIs (``metering.api.organization``).
"""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    inline_serializer,
)
from rest_framework import serializers
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.auth import CanReadReports
from config.api import ControlPlaneView, ErrorSerializer, openapi_pattern
from config.errors import InvalidRequest
from config.names import SLUG_PATTERN, SLUG_RULE, is_valid_slug
from metering import reports
from metering.domain.periods import INSTANT_PATTERN

__all__ = ["UsageReportView"]

_FORMATS = ("json", "csv")


class ReportCSVRenderer(BaseRenderer):
    """The report as CSV (``reports.report_csv`` writes it; this only sends it)."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: Any = None,
    ) -> bytes:
        return data.encode() if isinstance(data, str) else b""


class UsageReportView(ControlPlaneView):
    """Usage and cost per team, model and region, per day or month."""

    permission_classes = [CanReadReports]
    renderer_classes = [JSONRenderer, ReportCSVRenderer]

    @extend_schema(
        operation_id="reports_usage",
        parameters=[
            OpenApiParameter(
                "from",
                str,
                required=False,
                description="Start (YYYY-MM, YYYY-MM-DD or ISO 8601; UTC). "
                "Default: the start of this month.",
                pattern=INSTANT_PATTERN,
            ),
            OpenApiParameter(
                "to",
                str,
                required=False,
                description="End, exclusive; a month or a day given here is "
                "included. Default: now.",
                pattern=INSTANT_PATTERN,
            ),
            OpenApiParameter("group_by", str, enum=["day", "month"], required=False),
            OpenApiParameter(
                "team",
                str,
                required=False,
                description=f"Only this team's rows: {SLUG_RULE}.",
                pattern=openapi_pattern(SLUG_PATTERN),
            ),
            OpenApiParameter(
                "model",
                str,
                required=False,
                description=f"Only this model: {SLUG_RULE}.",
                pattern=openapi_pattern(SLUG_PATTERN),
            ),
            OpenApiParameter(
                "region",
                str,
                required=False,
                description="Only this region's usage and pools (rows are per "
                f"region either way): {SLUG_RULE}.",
                pattern=openapi_pattern(SLUG_PATTERN),
            ),
            OpenApiParameter("format", str, enum=list(_FORMATS), required=False),
        ],
        responses={
            (200, "application/json"): OpenApiTypes.OBJECT,
            (200, "text/csv"): OpenApiResponse(
                response=inline_serializer(
                    name="UsageReportCSVLine",
                    fields={c: serializers.CharField() for c in reports.CSV_COLUMNS},
                    many=True,
                ),
                description="The rows, then the idle lines, as CSV with a header "
                "line (one object per line here).",
            ),
            404: OpenApiResponse(
                response=ErrorSerializer,
                description="The team or model named does not exist.",
            ),
        },
    )
    def get(self, request: Request) -> Response:
        params = request.query_params
        for name in ("team", "model", "region"):
            value = params.get(name)
            if value is not None and not is_valid_slug(value):
                raise InvalidRequest(f"{name} must be {SLUG_RULE}", param=name)
        for name in ("from", "to", "group_by"):
            if params.get(name) == "":
                raise InvalidRequest(f"{name} is empty: leave it out", param=name)
        now = timezone.now()
        query = reports.report_query(params, now=now)
        report = reports.usage_report(query, now=now)
        if request.accepted_renderer.format == "csv":
            name = f"usage-{query.start:%Y-%m-%d}-{query.end:%Y-%m-%d}.csv"
            return Response(
                reports.report_csv(report),
                headers={"Content-Disposition": f'attachment; filename="{name}"'},
            )
        return Response(report.as_dict())

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        # Before DRF's content negotiation, which would answer an unknown format 404.
        fmt = request.query_params.get("format")
        if fmt is not None and fmt not in _FORMATS:
            raise InvalidRequest("format must be json or csv", param="format")
        super().initial(request, *args, **kwargs)

    def handle_exception(self, exc: Exception) -> Response:
        # Errors are JSON in the API's shape, whatever format was asked for.
        response = super().handle_exception(exc)
        self.request.accepted_renderer = JSONRenderer()
        self.request.accepted_media_type = "application/json"
        return response
