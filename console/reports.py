"""The Reports page: usage and cost per team and month, for finance and admins.

``/console/reports/`` shows the report's rows (tokens, 429s, shed, USD per team,
model and region; a region filter narrows it to one) with the idle lines and each pool's GPU-hours, utilisation and USD per million tokens, a
chart of USD per month and team, and a CSV download (``/console/reports/usage.csv``)
of the same report. Both need ``metering.view_cost_report`` (the finance group has
it, ``metering.roles``); nothing here shows keys, limits or the fleet.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache

from accounts.models import Team
from config.errors import PlatformError
from console.views import _context
from metering import reports
from models_registry.models import Model, Pool

__all__ = ["report_csv", "report_page"]

PERMISSION = "metering.view_cost_report"
# Months the page shows when none are asked for: this one and the five before.
DEFAULT_MONTHS = 6


def _default_from(now: datetime) -> str:
    month = now.astimezone(UTC).month - (DEFAULT_MONTHS - 1)
    year = now.astimezone(UTC).year
    while month < 1:
        month += 12
        year -= 1
    return f"{year:04d}-{month:02d}"


def _report(
    request: HttpRequest, *, asked: bool = True
) -> tuple[reports.Report, dict[str, str]]:
    """Return the report asked for (monthly; by default the last six months), or
    with ``asked=False`` the default one."""
    if not request.user.has_perm(PERMISSION):
        raise PermissionDenied(f"needs {PERMISSION}")
    now = timezone.now()
    get = request.GET if asked else {}
    params = {
        "from": get.get("from") or _default_from(now),
        "to": get.get("to") or "",
        "team": get.get("team") or "",
        "model": get.get("model") or "",
        "region": get.get("region") or "",
    }
    query = reports.report_query({**params, "group_by": "month"}, now=now)
    return reports.usage_report(query, now=now), params


def _filename(query: reports.ReportQuery) -> str:
    start = f"{query.start:%Y-%m}"
    last = reports.last_month_of(query)
    return f"usage-{start}.csv" if last == start else f"usage-{start}-to-{last}.csv"


def _chart(report: reports.Report) -> dict[str, Any]:
    """USD per month: one series per team, and one for idle."""
    months = sorted({r["period"] for r in [*report.rows, *report.idle]})
    series: dict[str, dict[str, float]] = {}
    for row in report.rows:
        by_month = series.setdefault(row["team"], {})
        by_month[row["period"]] = by_month.get(row["period"], 0.0) + row["usd"]
    idle: dict[str, float] = {}
    for row in report.idle:
        idle[row["period"]] = idle.get(row["period"], 0.0) + row["usd"]
    datasets = [
        {"label": team, "data": [round(v.get(m, 0.0), 2) for m in months]}
        for team, v in sorted(series.items())
    ]
    if idle:
        datasets.append(
            {"label": "idle", "data": [round(idle.get(m, 0.0), 2) for m in months]}
        )
    return {"labels": months, "datasets": datasets}


def _regions(report: reports.Report) -> list[str]:
    """The regions a report can be narrowed to: those with pools, and those the
    report's rows name (a region whose pools are gone; no scan of the usage)."""
    pools = Pool.objects.order_by("region").values_list("region", flat=True).distinct()
    return sorted(set(pools) | {r["region"] for r in report.rows})


@never_cache
def report_page(request: HttpRequest) -> HttpResponse:
    """Per team and month: tokens, 429s, shed and USD, with idle cost and pools."""
    try:
        report, params = _report(request)
    except PlatformError as exc:
        messages.error(
            request, f"{exc.message}; showing the last {DEFAULT_MONTHS} months"
        )
        report, params = _report(request, asked=False)
    query = report.query
    return TemplateResponse(
        request,
        "console/reports.html",
        _context(
            request,
            "Usage and cost",
            report=report,
            totals=report.totals(),
            params=params,
            csv_query=urlencode({k: v for k, v in params.items() if v}),
            csv_filename=_filename(query),
            chart=_chart(report),
            teams=Team.objects.order_by("team").values_list("team", flat=True),
            models=Model.objects.order_by("model").values_list("model", flat=True),
            regions=_regions(report),
        ),
    )


@never_cache
def report_csv(request: HttpRequest) -> HttpResponse:
    """The page's report as CSV (``metering.reports.report_csv``)."""
    try:
        report, _ = _report(request)
    except PlatformError as exc:
        return HttpResponse(
            f"{exc.message}\n", status=400, content_type="text/plain; charset=utf-8"
        )
    response = HttpResponse(
        reports.report_csv(report), content_type="text/csv; charset=utf-8"
    )
    response["Content-Disposition"] = (
        f'attachment; filename="{_filename(report.query)}"'
    )
    return response
