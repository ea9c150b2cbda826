"""A team's own usage and cost with its API key, in OpenAI's organization shapes.

- ``GET /v1/organization/usage/completions``: ``start_time`` (Unix seconds,
  required), ``end_time``, ``bucket_width`` (``1m``, ``1h`` or ``1d``; default
  ``1d``), ``group_by`` (``model``, ``batch``), ``models``, ``regions``,
  ``batch``, ``limit``, ``page``. Each bucket lists results with ``input_tokens``, ``output_tokens``,
  ``input_cached_tokens``, ``num_model_requests`` (and, beyond OpenAI's fields,
  ``rate_limited_requests`` and ``shed_requests``: the team's 429s and 503s).
- ``GET /v1/organization/costs``: ``start_time``, ``end_time``, ``bucket_width``
  (``1d`` only), ``group_by`` (``line_item``: one line per model), ``regions``,
  ``limit``, ``page``. ``amount.value`` is what the cost model bills the team (its share of
  the used GPU time, ``metering.reports``), in USD.

The key's team is the organization: a team sees only its own usage, and a key of
another team cannot name it. Buckets are aligned to UTC minutes, hours or days.
Every bucket in range is listed, empty or not; ``next_page`` continues after the
last one.

``regions`` (beyond OpenAI's filters, shaped like ``models``) keeps the usage
counted, and the cost billed, in those regions only: a region's tokens pay its
own pools' GPU-hours, so the regions' costs add up to the whole.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Sum
from django.db.models.functions import TruncDay, TruncHour, TruncMinute
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.api.team_view import TeamView
from config.api import openapi_pattern
from config.errors import InvalidRequest
from config.names import SLUG_PATTERN, SLUG_RULE, is_valid_slug
from metering import reports
from metering.models import Usage

__all__ = ["CompletionsUsageView", "CostsView"]

_WIDTHS = {
    "1m": (timedelta(minutes=1), TruncMinute, 60, 1440),
    "1h": (timedelta(hours=1), TruncHour, 24, 168),
    "1d": (timedelta(days=1), TruncDay, 7, 31),
}
_COST_LIMITS = (7, 180)
_USAGE_GROUPS = ("model", "batch")
_UNSUPPORTED_GROUPS = ("project_id", "user_id", "api_key_id")
_PAGE_PREFIX = "page_"
_PAGE = re.compile(r"^page_([0-9]{1,12})$")
# Instants at most this (Unix seconds: the year 9000), so that a window of the
# longest bucket and limit after one stays a datetime.
_MAX_UNIX_S = 221845392000


def _list(request: Request, name: str) -> list[str]:
    """A query parameter given once, repeated, or as ``name[]``, or comma-separated."""
    values = request.query_params.getlist(name) + request.query_params.getlist(
        f"{name}[]"
    )
    return [item.strip() for v in values for item in v.split(",") if item.strip()]


def _regions(request: Request) -> list[str]:
    """The ``regions`` filter: region names (slugs), none for every region."""
    regions = _list(request, "regions")
    for region in regions:
        if not is_valid_slug(region):
            raise InvalidRequest(
                f"each of regions must be {SLUG_RULE}", param="regions"
            )
    return regions


def _int(request: Request, name: str, *, required: bool = False) -> int | None:
    text = request.query_params.get(name)
    if text is None or text == "":
        if required:
            raise InvalidRequest(f"{name} is required (Unix seconds)", param=name)
        return None
    try:
        value = int(text)
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer", param=name) from None
    if not 0 <= value < _MAX_UNIX_S:
        raise InvalidRequest(f"{name} is out of range", param=name)
    return value


def _floor(at: datetime, width: timedelta) -> datetime:
    seconds = int(width.total_seconds())
    epoch = int(at.timestamp())
    return datetime.fromtimestamp(epoch - epoch % seconds, tz=UTC)


def _window(
    request: Request, width: timedelta, default_limit: int, max_limit: int
) -> tuple[datetime, datetime, int, bool]:
    """Return the buckets asked for: first start, end, and whether more follow."""
    start_s = _int(request, "start_time", required=True)
    end_s = _int(request, "end_time")
    limit = _int(request, "limit")
    if limit is None:
        limit = default_limit
    if not 1 <= limit <= max_limit:
        raise InvalidRequest(f"limit must be 1 to {max_limit}", param="limit")
    page = request.query_params.get("page")
    assert start_s is not None
    start = datetime.fromtimestamp(start_s, tz=UTC)
    if page:
        cursor = _PAGE.match(page)
        if cursor is None or int(cursor[1]) >= _MAX_UNIX_S:
            raise InvalidRequest(
                "page must be a next_page of a previous answer", param="page"
            )
        start = datetime.fromtimestamp(int(cursor[1]), tz=UTC)
    end = datetime.fromtimestamp(end_s, tz=UTC) if end_s is not None else timezone.now()
    if end_s is not None and end_s <= start_s:
        raise InvalidRequest("end_time must be after start_time", param="end_time")
    first = _floor(start, width)
    last = first + width * limit
    return first, min(end, last), limit, end > last


def _page(
    buckets: Iterable[tuple[datetime, list[dict[str, Any]]]],
    width: timedelta,
    *,
    has_more: bool,
) -> dict[str, Any]:
    data = [
        {
            "object": "bucket",
            "start_time": int(start.timestamp()),
            "end_time": int((start + width).timestamp()),
            "results": results,
        }
        for start, results in buckets
    ]
    next_page = None
    if has_more and data:
        next_page = f"{_PAGE_PREFIX}{data[-1]['end_time']}"
    return {
        "object": "page",
        "data": data,
        "has_more": has_more,
        "next_page": next_page,
    }


def _starts(first: datetime, end: datetime, width: timedelta) -> list[datetime]:
    starts = []
    at = first
    while at < end:
        starts.append(at)
        at += width
    return starts


def _result(
    *, prompt: int, cached: int, output: int, requests: int, is_batch: bool | None
) -> dict[str, Any]:
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": prompt,
        "output_tokens": output,
        "input_cached_tokens": cached,
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": requests,
        "project_id": None,
        "user_id": None,
        "api_key_id": None,
        "model": None,
        "batch": is_batch,
    }


def _lines(n: dict[str, int], *, split: bool) -> list[dict[str, Any]]:
    """One result for a row of sums, or, split, its interactive and batch parts.

    Beyond OpenAI's fields each result has ``rate_limited_requests`` and
    ``shed_requests``, the team's 429s and 503s (refusals are not batch work).
    Usage keeps how much was batch work but not its cached part, so cached tokens
    stay with the interactive line.
    """
    refused = {"rate_limited_requests": n["rate_limited"], "shed_requests": n["shed"]}
    if not split:
        whole = _result(
            prompt=n["prompt_tokens"],
            cached=n["cached_tokens"],
            output=n["output_tokens"],
            requests=n["requests"],
            is_batch=None,
        )
        return [{**whole, **refused}]
    interactive = _result(
        prompt=n["prompt_tokens"] - n["batch_prompt_tokens"],
        cached=min(n["cached_tokens"], n["prompt_tokens"] - n["batch_prompt_tokens"]),
        output=n["output_tokens"] - n["batch_output_tokens"],
        requests=n["requests"] - n["batch_requests"],
        is_batch=False,
    )
    lines = [{**interactive, **refused}]
    if n["batch_requests"] or n["batch_output_tokens"] or n["batch_prompt_tokens"]:
        batch = _result(
            prompt=n["batch_prompt_tokens"],
            cached=0,
            output=n["batch_output_tokens"],
            requests=n["batch_requests"],
            is_batch=True,
        )
        lines.append({**batch, "rate_limited_requests": 0, "shed_requests": 0})
    return lines


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_COUNT = {"type": "integer", "minimum": 0}
_USAGE_RESULT: dict[str, Any] = {
    "type": "object",
    "required": ["object", "input_tokens", "output_tokens", "num_model_requests"],
    "properties": {
        "object": {"const": "organization.usage.completions.result"},
        **{
            name: _COUNT
            for name in (
                "input_tokens",
                "output_tokens",
                "input_cached_tokens",
                "input_audio_tokens",
                "output_audio_tokens",
                "num_model_requests",
                "rate_limited_requests",
                "shed_requests",
            )
        },
        "project_id": {"type": "null"},
        "user_id": {"type": "null"},
        "api_key_id": {"type": "null"},
        "model": _nullable({"type": "string"}),
        "batch": _nullable({"type": "boolean"}),
    },
}
_COST_RESULT: dict[str, Any] = {
    "type": "object",
    "required": ["object", "amount"],
    "properties": {
        "object": {"const": "organization.costs.result"},
        "amount": {
            "type": "object",
            "required": ["value", "currency"],
            "properties": {"value": {"type": "number"}, "currency": {"const": "usd"}},
        },
        "line_item": _nullable({"type": "string"}),
        "project_id": {"type": "null"},
    },
}


def _page_schema(result: dict[str, Any]) -> dict[str, Any]:
    bucket = {
        "type": "object",
        "required": ["object", "start_time", "end_time", "results"],
        "properties": {
            "object": {"const": "bucket"},
            "start_time": {"type": "integer"},
            "end_time": {"type": "integer"},
            "results": {"type": "array", "items": result},
        },
    }
    return {
        "type": "object",
        "required": ["object", "data", "has_more", "next_page"],
        "properties": {
            "object": {"const": "page"},
            "data": {"type": "array", "items": bucket},
            "has_more": {"type": "boolean"},
            "next_page": _nullable({"type": "string"}),
        },
    }


def _time(name: str, *, required: bool = False) -> OpenApiParameter:
    return OpenApiParameter(
        name,
        {"type": "integer", "minimum": 0, "maximum": _MAX_UNIX_S - 1},
        required=required,
        description="Unix seconds.",
    )


def _window_parameters(max_limit: int) -> list[OpenApiParameter]:
    return [
        OpenApiParameter(
            "regions",
            {
                "type": "array",
                "items": {"type": "string", "pattern": openapi_pattern(SLUG_PATTERN)},
            },
            explode=True,
            description="Only the usage and cost of these regions (not OpenAI's: "
            f"this platform's). Each {SLUG_RULE}.",
        ),
        _time("start_time", required=True),
        _time("end_time"),
        OpenApiParameter(
            "limit", {"type": "integer", "minimum": 1, "maximum": max_limit}
        ),
        OpenApiParameter(
            "page",
            OpenApiTypes.STR,
            description="A next_page of a previous answer.",
            pattern=_PAGE.pattern,
        ),
    ]


class CompletionsUsageView(TeamView):
    """The team's completions usage per bucket (OpenAI's organization usage)."""

    @extend_schema(
        operation_id="usageCompletions",
        summary="The team's completions usage per bucket.",
        description="The limit's most depends on bucket_width (1440 of 1m, 168 of "
        "1h, 31 of 1d); end_time must be after start_time.",
        parameters=[
            *_window_parameters(max(w[3] for w in _WIDTHS.values())),
            OpenApiParameter("bucket_width", {"enum": sorted(_WIDTHS)}),
            OpenApiParameter(
                "group_by",
                {"type": "array", "items": {"enum": list(_USAGE_GROUPS)}},
                explode=True,
            ),
            OpenApiParameter(
                "models", {"type": "array", "items": {"type": "string"}}, explode=True
            ),
            OpenApiParameter("batch", {"enum": ["true", "false"]}),
        ],
        responses={200: _page_schema(_USAGE_RESULT)},
    )
    def get(self, request: Request) -> Response:
        width_name = request.query_params.get("bucket_width") or "1d"
        if width_name not in _WIDTHS:
            raise InvalidRequest(
                "bucket_width must be 1m, 1h or 1d", param="bucket_width"
            )
        width, trunc, default_limit, max_limit = _WIDTHS[width_name]
        groups = _list(request, "group_by")
        for group in groups:
            if group in _UNSUPPORTED_GROUPS:
                raise InvalidRequest(
                    f"group_by {group} is not kept here: usage is per team and model",
                    param="group_by",
                )
            if group not in _USAGE_GROUPS:
                raise InvalidRequest("group_by takes model and batch", param="group_by")
        first, end, _, has_more = _window(request, width, default_limit, max_limit)
        rows = Usage.objects.filter(
            team_id=self.team(request), minute__gte=first, minute__lt=end
        )
        models = _list(request, "models")
        if models:
            rows = rows.filter(model_id__in=models)
        regions = _regions(request)
        if regions:
            rows = rows.filter(region__in=regions)
        batch = request.query_params.get("batch")
        if batch not in (None, "", "true", "false"):
            raise InvalidRequest("batch must be true or false", param="batch")
        fields = (
            "prompt_tokens",
            "cached_tokens",
            "output_tokens",
            "requests",
            "batch_prompt_tokens",
            "batch_output_tokens",
            "batch_requests",
            "rate_limited",
            "shed",
        )
        by = ("model_id",) if "model" in groups else ()
        summed = (
            rows.annotate(bucket=trunc("minute", tzinfo=UTC))
            .values("bucket", *by)
            .annotate(**{f"sum_{f}": Sum(f) for f in fields})
            .order_by("bucket", *by)
        )
        split = "batch" in groups or bool(batch)
        results: dict[datetime, list[dict[str, Any]]] = defaultdict(list)
        for row in summed:
            counts = {f: int(row[f"sum_{f}"] or 0) for f in fields}
            for line in _lines(counts, split=split):
                if batch and line["batch"] is not (batch == "true"):
                    continue
                line["model"] = row["model_id"] if by else None
                if "batch" not in groups:
                    line["batch"] = None
                results[row["bucket"].astimezone(UTC)].append(line)
        buckets = [(s, results.get(s, [])) for s in _starts(first, end, width)]
        return Response(_page(buckets, width, has_more=has_more))


class CostsView(TeamView):
    """The team's cost per day (OpenAI's organization costs), from the cost model."""

    @extend_schema(
        operation_id="costs",
        summary="The team's cost per day, in USD.",
        description="end_time must be after start_time.",
        parameters=[
            *_window_parameters(_COST_LIMITS[1]),
            OpenApiParameter("bucket_width", {"enum": ["1d"]}),
            OpenApiParameter(
                "group_by",
                {"type": "array", "items": {"enum": ["line_item", "project_id"]}},
                explode=True,
            ),
        ],
        responses={200: _page_schema(_COST_RESULT)},
    )
    def get(self, request: Request) -> Response:
        width_name = request.query_params.get("bucket_width") or "1d"
        if width_name != "1d":
            raise InvalidRequest("bucket_width must be 1d", param="bucket_width")
        groups = _list(request, "group_by")
        if any(g not in ("line_item", "project_id") for g in groups):
            raise InvalidRequest(
                "group_by takes line_item and project_id", param="group_by"
            )
        regions = _regions(request)
        width = timedelta(days=1)
        first, end, _, has_more = _window(request, width, *_COST_LIMITS)
        team = self.team(request)
        now = timezone.now()
        query = reports.ReportQuery(
            start=first,
            end=min(end, now) if end > first else end,
            group_by="day",
            team=team,
        )
        results: dict[str, list[dict[str, Any]]] = defaultdict(list)
        if query.end > query.start:
            report = reports.usage_report(query, now=now)
            by_day: dict[str, dict[str | None, float]] = defaultdict(
                lambda: defaultdict(float)
            )
            for row in report.rows:
                if regions and row["region"] not in regions:
                    continue
                line = row["model"] if "line_item" in groups else None
                by_day[row["period"]][line] += row["usd"]
            for day, lines in by_day.items():
                for line, usd in sorted(lines.items(), key=lambda kv: kv[0] or ""):
                    results[day].append(
                        {
                            "object": "organization.costs.result",
                            "amount": {"value": round(usd, 6), "currency": "usd"},
                            "line_item": line,
                            "project_id": None,
                        }
                    )
        buckets = [
            (s, results.get(f"{s:%Y-%m-%d}", [])) for s in _starts(first, end, width)
        ]
        return Response(_page(buckets, width, has_more=has_more))
