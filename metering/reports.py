"""Usage and cost reports: the usage table added up per day or month, priced by the
cost model (``metering.domain.cost``) over the replicas' state history.

Public surface: ``ReportQuery``, ``Report``, ``report_query``, ``usage_report``,
``report_csv``, ``CSV_COLUMNS``, ``token_weights``, ``TOKEN_FIELDS``.

A report covers ``[start, end)`` in UTC periods. For each period, version and
region the GPU time of the region's pools is priced at the region's GPU-hour price,
and the used part is split between all the teams that used the version in that
region; the rows (one per period, team, model and region) then keep only the team,
model and region asked for. The idle part of each model's cost in a region is its
own line (``line: idle``), so the teams' bills and the idle lines add up to what
the GPUs cost, in each region and in total.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Sum
from django.db.models.functions import TruncDay, TruncMonth

from config.errors import InvalidRequest, NotFound
from config.names import SLUG_RULE, is_valid_slug
from metering.domain.cost import (
    PoolCost,
    Span,
    TeamTokens,
    TokenWeights,
    VersionCost,
    allocate,
    gpu_hour_usd_for,
    pool_times,
    replica_tokens_per_s,
)
from metering.domain.periods import GROUP_BYS, Period, parse_instant, periods
from metering.models import Usage
from metering.spans import spans_between

__all__ = [
    "CSV_COLUMNS",
    "TOKEN_FIELDS",
    "Report",
    "ReportQuery",
    "last_month_of",
    "report_csv",
    "report_query",
    "token_weights",
    "usage_report",
]

TOKEN_FIELDS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "batch_requests",
    "batch_prompt_tokens",
    "batch_output_tokens",
    "rate_limited",
    "shed",
)
CSV_COLUMNS = (
    "period",
    "line",
    "team",
    "model",
    "region",
    *TOKEN_FIELDS,
    "weighted_tokens",
    "usd",
)
# The longest window a report may ask for: day rows over a year, month rows over ten.
_MAX_DAYS = {"day": 400, "month": 3700}
_USD_DIGITS = 6


def last_month_of(query: ReportQuery) -> str:
    """Return the month (``YYYY-MM``) that holds the report's last instant."""
    return f"{query.end - timedelta(microseconds=1):%Y-%m}"


def token_weights() -> TokenWeights:
    """Return the split's token weights from ``PLATFORM_COST_WEIGHTS``."""
    return TokenWeights(**settings.PLATFORM_COST_WEIGHTS)


@dataclass(frozen=True, slots=True)
class ReportQuery:
    """What a report covers: ``[start, end)``, rows per ``group_by``, optionally one
    team, one model and one region."""

    start: datetime
    end: datetime
    group_by: str = "month"
    team: str | None = None
    model: str | None = None
    region: str | None = None


def report_query(params: Mapping[str, str], *, now: datetime) -> ReportQuery:
    """Read ``from``, ``to``, ``group_by``, ``team``, ``model`` and ``region`` from a
    query string.

    ``from`` defaults to the start of this month, ``to`` to now; each is
    ``YYYY-MM``, ``YYYY-MM-DD`` or an ISO 8601 instant, and a month or day as ``to``
    includes it.

    Raises:
        InvalidRequest: a bad value, with the parameter it came from.
    """
    group_by = params.get("group_by") or "month"
    region = params.get("region") or None
    if region is not None and not is_valid_slug(region):
        raise InvalidRequest(f"region must be {SLUG_RULE}", param="region")
    if group_by not in GROUP_BYS:
        raise InvalidRequest(
            f"group_by must be one of {', '.join(GROUP_BYS)}", param="group_by"
        )
    bounds: list[datetime | None] = []
    for name, is_end in (("from", False), ("to", True)):
        text = params.get(name)
        if not text:
            bounds.append(None)
            continue
        try:
            bounds.append(parse_instant(text, is_end=is_end))
        except (ValueError, OverflowError):
            raise InvalidRequest(
                f"{name} must be YYYY-MM, YYYY-MM-DD or an ISO 8601 instant",
                param=name,
            ) from None
    start = bounds[0] or now.astimezone(UTC).replace(
        day=1, hour=0, minute=0, second=0, microsecond=0
    )
    end = bounds[1] or now
    if end <= start:
        raise InvalidRequest("to must be after from", param="to")
    if end - start > timedelta(days=_MAX_DAYS[group_by]):
        raise InvalidRequest(
            f"a report by {group_by} covers at most {_MAX_DAYS[group_by]} days",
            param="from",
        )
    return ReportQuery(
        start=start,
        end=end,
        group_by=group_by,
        team=params.get("team") or None,
        model=params.get("model") or None,
        region=region,
    )


@dataclass
class Report:
    """A report's rows as plain values (JSON- and CSV-ready), and its totals."""

    query: ReportQuery
    weights: TokenWeights
    rows: list[dict[str, Any]] = field(default_factory=list)
    idle: list[dict[str, Any]] = field(default_factory=list)
    pools: list[dict[str, Any]] = field(default_factory=list)
    versions: list[dict[str, Any]] = field(default_factory=list)

    def totals(self) -> dict[str, Any]:
        """Sums of the rows (and of the idle lines, which a team's report has none of)."""
        totals: dict[str, Any] = {f: sum(r[f] for r in self.rows) for f in TOKEN_FIELDS}
        totals["weighted_tokens"] = round(
            sum(r["weighted_tokens"] for r in self.rows), 3
        )
        totals["usd"] = round(sum(r["usd"] for r in self.rows), _USD_DIGITS)
        totals["idle_usd"] = round(sum(r["usd"] for r in self.idle), _USD_DIGITS)
        totals["gpu_usd"] = round(sum(p["usd"] for p in self.pools), _USD_DIGITS)
        return totals

    def as_dict(self) -> dict[str, Any]:
        q = self.query
        return {
            "object": "usage_report",
            "from": q.start.isoformat(),
            "to": q.end.isoformat(),
            "group_by": q.group_by,
            "team": q.team,
            "model": q.model,
            "region": q.region,
            "currency": "usd",
            "gpu_hour_usd": settings.PLATFORM_GPU_HOUR_USD,
            "gpu_hour_usd_by_region": dict(settings.PLATFORM_GPU_HOUR_USD_BY_REGION),
            "weights": {
                "prompt": self.weights.prompt,
                "cached": self.weights.cached,
                "output": self.weights.output,
            },
            "data": self.rows,
            "idle": self.idle,
            "versions": self.versions,
            "pools": self.pools,
            "totals": self.totals(),
        }


def _usage_by_version(
    query: ReportQuery,
) -> dict[str, list[tuple[TeamTokens, dict[str, int]]]]:
    """Return each period's usage per team, version and region (every team: the
    split needs all of them), with its counts."""
    trunc = TruncMonth if query.group_by == "month" else TruncDay
    rows = (
        Usage.objects.filter(minute__gte=query.start, minute__lt=query.end)
        .annotate(period=trunc("minute", tzinfo=UTC))
        .values("period", "team_id", "model_id", "version__version", "region")
        .annotate(**{f"sum_{f}": Sum(f) for f in TOKEN_FIELDS})
        .order_by("period", "team_id", "model_id", "version__version", "region")
    )
    if query.model:
        rows = rows.filter(model_id=query.model)
    if query.region:
        rows = rows.filter(region=query.region)
    label = "%Y-%m" if query.group_by == "month" else "%Y-%m-%d"
    found: dict[str, list[tuple[TeamTokens, dict[str, int]]]] = defaultdict(list)
    for values in rows:
        row: dict[str, Any] = dict(values)
        counts = {f: int(row[f"sum_{f}"] or 0) for f in TOKEN_FIELDS}
        tokens = TeamTokens(
            team=row["team_id"],
            model=row["model_id"],
            version=row["version__version"],
            region=row["region"],
            prompt_tokens=counts["prompt_tokens"],
            cached_tokens=counts["cached_tokens"],
            output_tokens=counts["output_tokens"],
        )
        found[row["period"].astimezone(UTC).strftime(label)].append((tokens, counts))
    return found


def _versions(
    keys: Iterable[tuple[str, str]],
) -> dict[tuple[str, str], tuple[int, float, bool]]:
    """Return (GPUs per replica, output tokens/s per replica, assumed?) per version."""
    from models_registry.models import ModelVersion

    wanted = set(keys)
    rows = ModelVersion.objects.filter(
        model_id__in={m for m, _ in wanted}, version__in={v for _, v in wanted}
    ).values_list("model_id", "version", "gpus_per_replica", "load_test_tokens_per_s")
    assumed = settings.PLATFORM_ASSUMED_TOKENS_PER_S
    return {
        (model, version): (gpus, *replica_tokens_per_s(measured, assumed=assumed))
        for model, version, gpus, measured in rows
        if (model, version) in wanted
    }


def _pool_costs(
    period: Period,
    spans: Sequence[Span],
    versions: Mapping[tuple[str, str], tuple[int, float, bool]],
    *,
    now: datetime,
) -> list[tuple[PoolCost, bool]]:
    """Return the period's pools priced, each with whether its capacity is assumed
    (no load test measured the version)."""
    hi = min(period.hi, now)
    if hi <= period.lo:
        return []
    times = pool_times(spans, start=period.lo, end=hi)
    default = settings.PLATFORM_GPU_HOUR_USD
    by_region = settings.PLATFORM_GPU_HOUR_USD_BY_REGION
    costs = []
    for time in times:
        # A version row is never deleted while replicas of it have history; were it,
        # the spans' own GPU count and the assumed capacity stand in.
        gpus, tokens_per_s, assumed = versions.get(
            (time.model, time.version),
            (
                max(1, round(time.gpu_s / time.held_s)),
                settings.PLATFORM_ASSUMED_TOKENS_PER_S,
                True,
            ),
        )
        pool = PoolCost(
            time=time,
            gpus_per_replica=gpus,
            gpu_hour_usd=gpu_hour_usd_for(
                time.region, default=default, by_region=by_region
            ),
            tokens_per_s=tokens_per_s,
        )
        costs.append((pool, assumed))
    return costs


def _usd(value: float) -> float:
    return round(value, _USD_DIGITS)


def usage_report(query: ReportQuery, *, now: datetime) -> Report:
    """Build the report for ``query`` as of ``now`` (open spans count until now).

    Raises:
        NotFound: the team or model named does not exist.
    """
    from accounts.models import Team
    from models_registry.models import Model, ModelKind

    if query.team and not Team.objects.filter(pk=query.team).exists():
        raise NotFound(f"no team {query.team!r}", param="team")
    if query.model and not Model.objects.filter(pk=query.model).exists():
        raise NotFound(f"no model {query.model!r}", param="model")
    weights = token_weights()
    report = Report(query=query, weights=weights)
    usage = _usage_by_version(query)
    # The whole window's history at once (two queries), then each period's part.
    spans = spans_between(query.start, min(query.end, now))
    versions = _versions((s.model, s.version) for s in spans)
    # Embedding models make no output tokens: they are priced per input token.
    embedding_models = frozenset(
        Model.objects.filter(kind=ModelKind.EMBEDDING).values_list("pk", flat=True)
    )
    for period in periods(query.start, query.end, query.group_by):
        priced = [
            (p, assumed)
            for p, assumed in _pool_costs(period, spans, versions, now=now)
            if query.model in (None, p.time.model)
            and query.region in (None, p.time.region)
        ]
        counted = usage.get(period.label, [])
        costs = allocate(
            [p for p, _ in priced],
            [t for t, _ in counted],
            weights=weights,
            input_priced=embedding_models,
        )
        counts_of = {
            (t.team, t.model, t.version, t.region): counts for t, counts in counted
        }
        assumed = {(p.time.model, p.time.version, p.time.region): a for p, a in priced}
        _add_period(report, period, costs, counts_of, assumed)
    return report


def _add_period(
    report: Report,
    period: Period,
    costs: list[VersionCost],
    counts_of: Mapping[tuple[str, str, str, str], Mapping[str, int]],
    assumed: Mapping[tuple[str, str, str], bool],
) -> None:
    team = report.query.team
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    idle: dict[tuple[str, str], float] = defaultdict(float)
    for cost in costs:
        idle[(cost.model, cost.region)] += cost.idle_usd
        for share in cost.teams:
            t = share.tokens
            if team is not None and t.team != team:
                continue
            row = rows.setdefault(
                (t.team, t.model, t.region),
                {
                    "period": period.label,
                    "period_start": period.start.isoformat(),
                    "line": "team",
                    "team": t.team,
                    "model": t.model,
                    "region": t.region,
                    **dict.fromkeys(TOKEN_FIELDS, 0),
                    "weighted_tokens": 0.0,
                    "usd": 0.0,
                },
            )
            for f, n in counts_of[(t.team, t.model, t.version, t.region)].items():
                row[f] += n
            row["weighted_tokens"] += share.weighted_tokens
            row["usd"] += share.usd
        for pool in cost.pools:
            report.pools.append(
                {
                    "period": period.label,
                    "model": pool.time.model,
                    "version": pool.time.version,
                    "region": pool.time.region,
                    "gpu_hours": round(pool.time.gpu_hours, 6),
                    "serving_replica_hours": round(pool.time.serving_s / 3600, 6),
                    "gpu_hour_usd": pool.gpu_hour_usd,
                    "usd": _usd(pool.usd),
                    "tokens_per_s_per_replica": pool.tokens_per_s,
                    "priced_by": cost.priced_by,
                    "capacity_is_assumed": assumed[
                        (pool.time.model, pool.time.version, pool.time.region)
                    ],
                    "usd_per_million_tokens_at_full": round(
                        pool.usd_per_million_at_full, 6
                    ),
                }
            )
    for _, row in sorted(rows.items()):
        row["weighted_tokens"] = round(row["weighted_tokens"], 3)
        row["usd"] = _usd(row["usd"])
        report.rows.append(row)
    if team is None:
        for (model, region), usd in sorted(idle.items()):
            if usd > 0:
                report.idle.append(
                    {
                        "period": period.label,
                        "period_start": period.start.isoformat(),
                        "line": "idle",
                        "team": "",
                        "model": model,
                        "region": region,
                        "usd": _usd(usd),
                    }
                )
    report.versions.extend(_version_summary(period, c) for c in costs)


def _version_summary(period: Period, cost: VersionCost) -> dict[str, Any]:
    return {
        "period": period.label,
        "model": cost.model,
        "version": cost.version,
        "region": cost.region,
        "usd": _usd(cost.usd),
        "gpu_hours": round(cost.gpu_hours, 6),
        "output_tokens": cost.output_tokens,
        "priced_by": cost.priced_by,
        "priced_tokens": cost.priced_tokens,
        "utilisation": None if cost.utilisation is None else round(cost.utilisation, 6),
        "teams_usd": _usd(cost.teams_usd),
        "idle_usd": _usd(cost.idle_usd),
        "usd_per_million_tokens": None
        if cost.usd_per_million_tokens is None
        else round(cost.usd_per_million_tokens, 6),
        "usd_per_million_tokens_at_full": None
        if cost.usd_per_million_tokens_at_full is None
        else round(cost.usd_per_million_tokens_at_full, 6),
    }


def _cell(value: Any) -> Any:
    """Keep a spreadsheet from reading a cell as a formula (names are slugs, but a
    report must be safe to open whatever they hold)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def report_csv(report: Report) -> str:
    """Return the report as CSV: one line per period, team, model and region, then
    the idle lines (per model and region); the same figures as the JSON ``data`` and
    ``idle``."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for row in [*report.rows, *report.idle]:
        writer.writerow(_cell(row.get(c, "")) if c in row else "" for c in CSV_COLUMNS)
    return out.getvalue()
