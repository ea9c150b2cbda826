"""What the console's pages show, read through the services that own each figure.

Public surface: ``Sees``, ``fleet_overview``, ``fleet_feed``, ``pool_feed``, ``open_rollouts``,
``rollout_page``, ``rollout_state``, ``start_rollout``, ``control_rollout``,
``team_usage``, ``ACTIONS``, and what they return: ``PoolRow``,
``PoolFeed``, ``FleetCells``, ``Alert``, ``FleetOverview``, ``FleetFeed``,
``RolloutPage``, ``TeamUsage``.

Nothing here is computed a second time: a pool's replicas, capacity, hit rate,
the autoscaler's last tick and decisions come from ``control.autoscaling.
pool_state`` (the admin API's ``/admin/pools/<model>/state``), and so do each
pool's live figures (TTFT, time per output token, hit rate, USD per million tokens,
the routers' tokens in flight and queue: the gateways' role ``pool`` figures and
live-load shares, rollout or not), rollouts move through ``rollouts.plans`` as the
admin API moves them. What the console adds is
the split of a model's state into its pools and the shape of each page.

Per pool, ``tokens_in_flight`` and ``queue_depth`` are the heartbeats of its
serving replicas that are not silent (the sums ``pool_state`` makes for the
whole model, split by pool); ``utilisation`` is those tokens over the pool's
capacity, live, and ``autoscaler_utilisation`` what the autoscaler's last tick saw
(queued tokens included). Hit rate and TTFT are the pool's own (its version in
its region) over ``engine_nodes.services.LIVE_FIGURES_WINDOW``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any, Literal, NotRequired, TypedDict

from django.conf import settings
from django.db.models import Sum
from django.db.models.functions import TruncDate

from accounts.models import ApiKey
from batches.models import Batch
from control import autoscaling
from control.autoscaling import DecisionOut, PoolOut, PoolStateOut, ReplicaStateOut
from engine_nodes.domain.liveness import ReplicaState
from metering.models import Usage
from models_registry.domain.gates import TRAFFIC_STATUSES
from models_registry.models import Model, ModelVersion, Pool
from models_registry.pools import get_pool
from models_registry.services import get_model
from rollouts import plans, services
from rollouts.domain.plan import Decision, RolloutPlan
from rollouts.models import Rollout
from rollouts.services import RolloutOut
from routing.domain.budget import month_of
from routing.services import month_budgets

__all__ = [
    "ACTIONS",
    "Alert",
    "FleetCells",
    "FleetFeed",
    "FleetOverview",
    "PoolFeed",
    "PoolRow",
    "RolloutPage",
    "Sees",
    "TeamUsage",
    "control_rollout",
    "fleet_feed",
    "fleet_overview",
    "open_rollouts",
    "pool_feed",
    "rollout_page",
    "rollout_state",
    "start_rollout",
    "team_usage",
]

# How long an ended rollout that was rolled back stays on the home page's alerts.
_ROLLED_BACK_ALERT = timedelta(hours=24)
# The console's buttons and the admin API's actions (``plans.Controls``) they send.
ACTIONS: dict[str, plans.Controls] = {
    "advance": plans.Controls.APPROVE,
    "pause": plans.Controls.PAUSE,
    "resume": plans.Controls.RESUME,
    "rollback": plans.Controls.ABORT,
}
_BATCH_RUNNING = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS)


# -- what the pages and their JSON feeds show ---------------------------------------


class PoolRow(TypedDict):
    """One pool of a model's ``pool_state`` as the console shows it."""

    pool: str  # model/version/region
    model: str
    version: str
    region: str
    kind: str  # chat | embedding
    serving_replicas: int
    desired_replicas: int
    starting_replicas: int
    min_replicas: int
    max_replicas: int
    tokens_in_flight: int  # its serving replicas' that still beat
    capacity_tokens_in_flight: int
    # An embedding pool's capacity in input tokens/s (serving replicas x one's)
    # and the input tokens/s the autoscaler last measured; None for chat.
    capacity_tokens_per_s: float | None
    admitted_tokens_per_s: float | None
    capacity_is_assumed: bool
    utilisation: float | None  # live: tokens in flight over capacity
    autoscaler_utilisation: float | None  # what the autoscaler's last tick saw
    queue_depth: int
    prefix_hit_rate: float | None  # the pool's, live
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    usd_per_million_tokens: float | None
    router_tokens_in_flight: int | None  # the gateways' count; None elsewhere
    router_queue_depth: int | None
    router_utilisation: float | None
    is_panicking: bool
    is_capacity_exhausted: bool
    last_reason: str | None
    observed_at: str | None  # ISO 8601
    warnings: list[str]
    replicas: list[ReplicaStateOut]
    decisions: list[DecisionOut]


class PoolFeed(PoolRow):
    """The pool page and its JSON feed."""

    refreshed_at: str  # ISO 8601


class FleetCells(TypedDict):
    """A pool's cells in the home page's table (its JSON feed)."""

    pool: str
    kind: str
    serving_replicas: int
    desired_replicas: int
    tokens_in_flight: int
    capacity_tokens_in_flight: int
    capacity_tokens_per_s: float | None
    admitted_tokens_per_s: float | None
    capacity_is_assumed: bool
    utilisation: float | None
    queue_depth: int
    ttft_p95_ms: float | None
    prefix_hit_rate: float | None
    last_reason: str | None


AlertKind = Literal[
    "capacity_exhausted",
    "panicking",
    "no_serving_replica",
    "replica_silent",
    "replica_stalled",
    "rollout_paused",
    "rollout_rolled_back",
    "batch_at_risk",
]


class Alert(TypedDict):
    """Something on the home page an operator should look at."""

    kind: AlertKind
    subject: str  # a pool, replica, version or batch
    text: str


class FleetOverview(TypedDict):
    """The home page: every pool, the running rollouts, the alerts."""

    pools: list[PoolRow]
    rollouts: list[Rollout]
    alerts: list[Alert]


class FleetFeed(TypedDict):
    """The home page's JSON feed."""

    refreshed_at: str  # ISO 8601
    pools: list[FleetCells]
    alerts: list[Alert]
    rollouts: list[RolloutOut]


class RolloutPage(TypedDict):
    """A model's rollout page (a template's context, not JSON)."""

    model: Model
    rollout: Rollout | None  # the running one, else the latest
    state: str | None  # rollout_state of it
    is_running: bool
    evaluations: list[dict[str, Any]]  # plans.evaluations
    history: list[Rollout]
    plan: RolloutPlan
    startable: list[ModelVersion]


class TeamUsage(TypedDict):
    """A team's usage of a model (on a day, when asked by day)."""

    team_id: str
    model_id: str
    day: NotRequired[date]
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    rate_limited: int
    shed: int
    batch_requests: int
    tokens: int  # prompt and output


class TeamBudgetRow(TypedDict):
    """One of a team's budgets this month, as the team page shows it."""

    model: str  # "" for the budget on all its models
    month: str
    monthly_usd: float
    spent_usd: float
    ratio: float
    soft_fraction: float
    hard_fraction: float
    state: Literal["ok", "soft", "hard"]


# -- pools -------------------------------------------------------------------------


def _is_counted(replica: ReplicaStateOut) -> bool:
    # As pool_state sums a model's load: serving replicas that still beat.
    return replica["state"] == ReplicaState.SERVING and not replica["is_silent"]


def _pool_row(state: PoolStateOut, pool: PoolOut) -> PoolRow:
    """Return one pool of a model's ``pool_state`` as the console shows it."""
    version, region = pool["version"], pool["region"]
    replicas = [
        r
        for r in state["replicas"]
        if r["version"] == version and r["region"] == region
    ]
    counted = [r for r in replicas if _is_counted(r)]
    tokens = sum(r["tokens_in_flight"] for r in counted)
    capacity = pool["capacity_tokens_in_flight"]
    return {
        "pool": f"{state['model']}/{version}/{region}",
        "model": state["model"],
        "version": version,
        "region": region,
        "kind": pool["kind"],
        "serving_replicas": pool["serving_replicas"],
        "desired_replicas": pool["desired_replicas"],
        "starting_replicas": pool["starting_replicas"],
        "min_replicas": pool["min_replicas"],
        "max_replicas": pool["max_replicas"],
        "tokens_in_flight": tokens,
        "capacity_tokens_in_flight": capacity,
        "capacity_tokens_per_s": pool["capacity_tokens_per_s"],
        "admitted_tokens_per_s": pool["admitted_tokens_per_s"],
        "capacity_is_assumed": pool["capacity_is_assumed"],
        "utilisation": tokens / capacity if capacity else None,
        "autoscaler_utilisation": pool["utilisation"],
        "queue_depth": sum(r["queue_depth"] for r in counted),
        "prefix_hit_rate": pool["prefix_hit_rate"],
        "ttft_p95_ms": pool["ttft_p95_ms"],
        "ttft_p99_ms": pool["ttft_p99_ms"],
        "tpot_p50_ms": pool["tpot_p50_ms"],
        "usd_per_million_tokens": pool["usd_per_million_tokens"],
        "router_tokens_in_flight": pool["router_tokens_in_flight"],
        "router_queue_depth": pool["router_queue_depth"],
        "router_utilisation": pool["router_utilisation"],
        "is_panicking": pool["is_panicking"],
        "is_capacity_exhausted": pool["is_capacity_exhausted"],
        "last_reason": pool["last_reason"],
        "observed_at": pool["observed_at"],
        "warnings": pool["warnings"],
        "replicas": replicas,
        "decisions": pool["decisions"],
    }


def _model_pools(model_id: str, *, now: datetime) -> list[PoolRow]:
    state = autoscaling.pool_state(model_id=model_id, now=now)
    return [_pool_row(state, pool) for pool in state["pools"]]


def pool_feed(*, model_id: str, version: str, region: str, now: datetime) -> PoolFeed:
    """Return one pool's live state (the pool page and its JSON feed).

    Raises:
        NotFound: no such model, or it has no pool of ``version`` in ``region``.
    """
    get_pool(model_id=model_id, version=version, region=region)
    state = autoscaling.pool_state(model_id=model_id, now=now, region=region)
    pool = next(p for p in state["pools"] if p["version"] == version)
    return {**_pool_row(state, pool), "refreshed_at": now.isoformat()}


# -- rollouts ----------------------------------------------------------------------


def rollout_state(rollout: Rollout) -> str:
    """Return ``running``, ``paused`` or how the rollout ended (its decision)."""
    if rollout.decision != Decision.PENDING:
        return rollout.decision
    return "paused" if rollout.paused else "running"


def open_rollouts() -> list[Rollout]:
    """Return the rollouts still running (one per model at most), by model."""
    return list(
        Rollout.objects.filter(decision=Decision.PENDING)
        .select_related("version", "previous_version")
        .order_by("model_id")
    )


def rollout_page(model_id: str) -> RolloutPage:
    """Return a model's rollout page: the running (else latest) rollout, its guard
    evaluations, its history and the versions a new rollout may start.

    Raises:
        NotFound: no such model.
    """
    model = get_model(model_id)
    history = list(
        Rollout.objects.filter(model=model).select_related(
            "version", "previous_version"
        )[:20]
    )
    current = next((r for r in history if r.decision == Decision.PENDING), None)
    shown = current or (history[0] if history else None)
    # What start_plan would accept: a version whose gates passed, not the live one.
    startable = ModelVersion.objects.filter(
        model=model, status__in=sorted(TRAFFIC_STATUSES)
    ).order_by("-created_at")
    if model.live_version_id is not None:
        startable = startable.exclude(pk=model.live_version_id)
    return {
        "model": model,
        "rollout": shown,
        "state": rollout_state(shown) if shown else None,
        "is_running": current is not None,
        "evaluations": plans.evaluations(shown, limit=20) if shown else [],
        "history": history,
        "plan": plans.model_plan(model),
        "startable": list(startable),
    }


def start_rollout(*, model_id: str, version: str, now: datetime) -> Rollout:
    """Start ``version`` on the model's rollout plan, as PUT .../rollout with a
    plan does (``plans.start_plan``); refused as the API refuses it."""
    return plans.start_plan(model_id=model_id, version=version, now=now)


def control_rollout(*, model_id: str, action: str, by: str, now: datetime) -> Rollout:
    """Advance, pause, resume or roll back the model's running rollout through
    ``plans.control``; refused as the API refuses it."""
    return plans.control(model_id, ACTIONS[action].value, by=by, now=now)


# -- the home page -----------------------------------------------------------------


def _pool_alerts(pool: PoolRow) -> Iterator[Alert]:
    name = pool["pool"]
    if pool["is_capacity_exhausted"]:
        yield {
            "kind": "capacity_exhausted",
            "subject": name,
            "text": "capacity exhausted",
        }
    if pool["is_panicking"]:
        yield {
            "kind": "panicking",
            "subject": name,
            "text": "autoscaler in panic mode",
        }
    if pool["desired_replicas"] and not pool["serving_replicas"]:
        yield {
            "kind": "no_serving_replica",
            "subject": name,
            "text": f"no replica serving ({pool['desired_replicas']} desired)",
        }
    for replica in pool["replicas"]:
        if replica["is_silent"]:
            yield {
                "kind": "replica_silent",
                "subject": replica["replica_id"],
                "text": f"silent since {replica['last_heartbeat'] or 'it started'} ({name})",
            }
        elif replica["state"] == ReplicaState.STALLED:
            yield {
                "kind": "replica_stalled",
                "subject": replica["replica_id"],
                "text": f"stalled ({name})",
            }


def _alerts(
    pools: Iterable[PoolRow],
    rollouts: Iterable[Rollout],
    *,
    now: datetime,
    sees: Sees,
) -> list[Alert]:
    alerts = [alert for pool in pools for alert in _pool_alerts(pool)]
    for rollout in rollouts:
        if rollout.paused:
            alerts.append(
                {
                    "kind": "rollout_paused",
                    "subject": str(rollout.version),
                    "text": rollout.reason or "paused",
                }
            )
    rolled_back = Rollout.objects.filter(
        decision=Decision.ROLLED_BACK, decided_at__gte=now - _ROLLED_BACK_ALERT
    ).select_related("version")
    for rollout in rolled_back if sees.rollouts else ():
        alerts.append(
            {
                "kind": "rollout_rolled_back",
                "subject": str(rollout.version),
                "text": rollout.reason or "rolled back",
            }
        )
    at_risk = Batch.objects.filter(at_risk=True, status__in=_BATCH_RUNNING)
    for batch in at_risk.order_by("deadline_at")[:20] if sees.batches else ():
        alerts.append(
            {
                "kind": "batch_at_risk",
                "subject": batch.pk,
                "text": batch.schedule_reason
                or f"may miss its deadline {batch.deadline_at:%Y-%m-%d %H:%M} UTC",
            }
        )
    return alerts


@dataclass(frozen=True, slots=True)
class Sees:
    """Which parts beside the fleet the user may see on the home page: rollouts
    (``rollouts.view_rollout``) and batches (``batches.view_batch``)."""

    rollouts: bool
    batches: bool


def fleet_overview(*, now: datetime, sees: Sees) -> FleetOverview:
    """Return the home page: every pool, the running rollouts and what is alerting
    (rollouts and batches only for a user who may see them)."""
    model_ids = sorted(set(Pool.objects.values_list("model_id", flat=True)))
    pools = [row for m in model_ids for row in _model_pools(m, now=now)]
    rollouts = open_rollouts() if sees.rollouts else []
    return {
        "pools": pools,
        "rollouts": rollouts,
        "alerts": _alerts(pools, rollouts, now=now, sees=sees),
    }


def _fleet_cells(pool: PoolRow) -> FleetCells:
    """Per pool, what the home page's feed carries (its table's cells)."""
    return {
        "pool": pool["pool"],
        "kind": pool["kind"],
        "serving_replicas": pool["serving_replicas"],
        "desired_replicas": pool["desired_replicas"],
        "tokens_in_flight": pool["tokens_in_flight"],
        "capacity_tokens_in_flight": pool["capacity_tokens_in_flight"],
        "capacity_tokens_per_s": pool["capacity_tokens_per_s"],
        "admitted_tokens_per_s": pool["admitted_tokens_per_s"],
        "capacity_is_assumed": pool["capacity_is_assumed"],
        "utilisation": pool["utilisation"],
        "queue_depth": pool["queue_depth"],
        "ttft_p95_ms": pool["ttft_p95_ms"],
        "prefix_hit_rate": pool["prefix_hit_rate"],
        "last_reason": pool["last_reason"],
    }


def fleet_feed(*, now: datetime, sees: Sees) -> FleetFeed:
    """Return the home page's figures as JSON: each pool's cells, the alerts and
    the running rollouts (as the admin API shows them)."""
    overview = fleet_overview(now=now, sees=sees)
    return {
        "refreshed_at": now.isoformat(),
        "pools": [_fleet_cells(p) for p in overview["pools"]],
        "alerts": overview["alerts"],
        "rollouts": [services.rollout_dict(r) for r in overview["rollouts"]],
    }


# -- teams -------------------------------------------------------------------------


def team_usage(
    *,
    since: datetime,
    team_id: str | None = None,
    team_ids: Collection[str] | None = None,
    by_day: bool = False,
) -> list[TeamUsage]:
    """Return usage since ``since`` per team and model (and day, with ``by_day``):
    requests, prompt (and cached), output tokens, 429s (rate limited) and shed.
    ``team_id`` or ``team_ids`` keep those teams only (a team's viewer)."""
    rows = Usage.objects.filter(minute__gte=since)
    if team_id is not None:
        rows = rows.filter(team_id=team_id)
    if team_ids is not None:
        rows = rows.filter(team_id__in=team_ids)
    keys = ["team_id", "model_id"]
    if by_day:
        rows = rows.annotate(day=TruncDate("minute"))
        keys.append("day")
    totals = (
        rows.values(*keys)
        .annotate(
            requests=Sum("requests"),
            prompt_tokens=Sum("prompt_tokens"),
            cached_tokens=Sum("cached_tokens"),
            output_tokens=Sum("output_tokens"),
            rate_limited=Sum("rate_limited"),
            shed=Sum("shed"),
            batch_requests=Sum("batch_requests"),
        )
        .order_by(*(["-day"] if by_day else []), "team_id", "model_id")
    )
    usage = []
    for row in totals:
        entry: TeamUsage = {
            "team_id": row["team_id"],
            "model_id": row["model_id"],
            "requests": row["requests"],
            "prompt_tokens": row["prompt_tokens"],
            "cached_tokens": row["cached_tokens"],
            "output_tokens": row["output_tokens"],
            "rate_limited": row["rate_limited"],
            "shed": row["shed"],
            "batch_requests": row["batch_requests"],
            "tokens": row["prompt_tokens"] + row["output_tokens"],
        }
        if by_day:
            entry["day"] = row["day"]
        usage.append(entry)
    return usage


def team_budgets(*, team_id: str, now: datetime) -> list[TeamBudgetRow]:
    """Return the team's budgets with this month's flushed spend (every region),
    and whether it is past the soft or the hard threshold (the page's banner).

    The spend is the usage table's, as in the gateways' snapshot: what the
    gateways spent since the last flush (about a minute) is not in it.
    """
    found = month_budgets(
        region=settings.PLATFORM_REGION,
        month=month_of(now.timestamp()),
        team_id=team_id,
    )
    rows: list[TeamBudgetRow] = []
    for record in sorted(found.values(), key=lambda r: r.model):
        spent = record.spent_here_usd + record.spent_elsewhere_usd
        ratio = spent / record.monthly_usd
        rows.append(
            {
                "model": record.model,
                "month": record.month,
                "monthly_usd": record.monthly_usd,
                "spent_usd": spent,
                "ratio": ratio,
                "soft_fraction": record.soft_fraction,
                "hard_fraction": record.hard_fraction,
                "state": "hard"
                if ratio >= record.hard_fraction
                else "soft"
                if ratio >= record.soft_fraction
                else "ok",
            }
        )
    return rows


class KeyMetadata(TypedDict):
    """What the console shows of a team's API key: never its secret or hash."""

    prefix: str
    name: str
    purpose: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


def team_keys(*, team_id: str) -> list[KeyMetadata]:
    """Return ``team_id``'s API keys, newest first, as metadata only."""
    return [
        {
            "prefix": key.prefix,
            "name": key.name,
            "purpose": key.purpose,
            "created_at": key.created_at,
            "last_used_at": key.last_used_at,
            "revoked_at": key.revoked_at,
        }
        for key in ApiKey.objects.filter(team_id=team_id).order_by("-created_at")
    ]
