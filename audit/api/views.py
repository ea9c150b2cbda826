"""The audit trail over HTTP: ``GET /admin/audit``, JSON or JSON lines.

Public surface: ``AuditView``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from audit import services
from audit.api.serializers import audit_entries, audit_page
from config.api import ControlPlaneView
from config.errors import InvalidRequest

__all__ = ["AuditView"]

_FORMATS = ("json", "jsonl")
DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000
MAX_ID = 2**63 - 1
# A day, or a day and a time (UTC unless an offset is given).
INSTANT_PATTERN = (
    r"^\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?(Z|[+-]\d{2}:\d{2})?)?$"
)
_INSTANT = re.compile(INSTANT_PATTERN)
_TEXT_PARAMS = {"actor": 200, "object_type": 100, "object_id": 200, "x_request_id": 64}


class JSONLinesRenderer(BaseRenderer):
    """The entries as JSON lines (``audit.services.json_lines`` writes them)."""

    media_type = "application/jsonl"
    format = "jsonl"
    charset = "utf-8"

    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: Any = None,
    ) -> bytes:
        return data.encode() if isinstance(data, str) else b""


def _instant(params: Any, name: str) -> datetime | None:
    text = params.get(name)
    if text is None:
        return None
    if not _INSTANT.match(text):
        raise InvalidRequest(f"{name} must be a day or an ISO 8601 time", param=name)
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"{name} is not a date that exists", param=name) from None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def _int(params: Any, name: str, *, low: int, high: int) -> int | None:
    text = params.get(name)
    if text is None:
        return None
    if not re.fullmatch(r"-?\d{1,19}", text) or not low <= int(text) <= high:
        raise InvalidRequest(
            f"{name} must be an integer from {low} to {high}", param=name
        )
    return int(text)


class AuditView(ControlPlaneView):
    """Read the audit trail, oldest first, a page at a time; ``format=jsonl``
    answers JSON lines (one entry a line) for export."""

    renderer_classes = [JSONRenderer, JSONLinesRenderer]

    @extend_schema(
        operation_id="audit_list",
        parameters=[
            OpenApiParameter(
                "actor",
                {"type": "string", "maxLength": _TEXT_PARAMS["actor"]},
                required=False,
                description="Only this actor's entries: its name exactly, as the "
                "entries write it.",
            ),
            OpenApiParameter(
                "object_type",
                {"type": "string", "maxLength": _TEXT_PARAMS["object_type"]},
                required=False,
                description="Only this type, as ``app.model`` (``accounts.apikey``).",
            ),
            OpenApiParameter(
                "object_id",
                {"type": "string", "maxLength": _TEXT_PARAMS["object_id"]},
                required=False,
                description="Only this object.",
            ),
            OpenApiParameter(
                "x_request_id",
                {"type": "string", "maxLength": _TEXT_PARAMS["x_request_id"]},
                required=False,
                description="Only what the request with this ``X-Request-Id`` "
                "changed (the id it sent, or the one it was answered with).",
            ),
            OpenApiParameter(
                "since",
                str,
                required=False,
                description="From this time, inclusive (a day or ISO 8601; UTC "
                "unless an offset is given).",
                pattern=INSTANT_PATTERN,
            ),
            OpenApiParameter(
                "until",
                str,
                required=False,
                description="Up to this time, exclusive.",
                pattern=INSTANT_PATTERN,
            ),
            OpenApiParameter(
                "after_id",
                {"type": "integer", "minimum": 0, "maximum": MAX_ID},
                required=False,
                description="Only entries after this id (the previous page's "
                "``next_after_id``).",
            ),
            OpenApiParameter(
                "limit",
                {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
                required=False,
                description=f"At most this many entries (default {DEFAULT_LIMIT}).",
            ),
            OpenApiParameter("format", str, enum=list(_FORMATS), required=False),
        ],
        responses={
            (200, "application/json"): audit_page(),
            (200, "application/jsonl"): OpenApiResponse(
                response=audit_entries(),
                description="The entries as JSON lines (one object per line here).",
            ),
        },
    )
    def get(self, request: Request) -> Response:
        params = request.query_params
        for name, longest in _TEXT_PARAMS.items():
            value = params.get(name)
            if value is not None and len(value) > longest:
                raise InvalidRequest(f"{name} is longer than {longest}", param=name)
        query = services.EntryFilter(
            actor=params.get("actor"),
            object_type=params.get("object_type"),
            object_id=params.get("object_id"),
            x_request_id=params.get("x_request_id"),
            since=_instant(params, "since"),
            until=_instant(params, "until"),
            after_id=_int(params, "after_id", low=0, high=MAX_ID),
        )
        limit = _int(params, "limit", low=1, high=MAX_LIMIT) or DEFAULT_LIMIT
        entries = list(services.filter_entries(query)[: limit + 1])
        page, more = entries[:limit], len(entries) > limit
        if request.accepted_renderer.format == "jsonl":
            return Response("".join(services.json_lines(page)))
        return Response(
            {
                "data": [services.entry_dict(entry) for entry in page],
                "next_after_id": page[-1].pk if more else None,
            }
        )

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        # Before DRF's content negotiation, which would answer an unknown format 404.
        fmt = request.query_params.get("format")
        if fmt is not None and fmt not in _FORMATS:
            raise InvalidRequest("format must be json or jsonl", param="format")
        super().initial(request, *args, **kwargs)

    def handle_exception(self, exc: Exception) -> Response:
        # Errors are JSON in the API's shape, whatever format was asked for.
        response = super().handle_exception(exc)
        self.request.accepted_renderer = JSONRenderer()
        self.request.accepted_media_type = "application/json"
        return response
