"""The console's own pages beside the admin's tables: the fleet at a glance, a
live pool page, rollouts with their controls, and each team's usage.

Every page sits behind the admin's login (``admin.site.admin_view``) and asks for
the view permission of what it shows: ``engine_nodes.view_replica`` for the fleet
and pools, ``rollouts.view_rollout`` for rollouts (``rollouts.change_rollout`` to
act on one), ``accounts.view_team`` for teams (a team's viewer has it on its own
teams only, ``console.team_viewers``). Without it a page answers 403; the
home page shows no fleet, only the tables the user may see (and Reports).

A rollout action is a POST (with the CSRF token) that calls the same service as
the admin API and comes back to the page with its result as a message; a refusal
(a ``PlatformError``) becomes an error message, never a 500.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin, messages
from django.contrib.auth.decorators import permission_required
from django.contrib.staticfiles import finders
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from accounts.models import Team
from audit.models import Source
from audit.services import audited
from config.api import admin_name
from config.errors import NotFound, PlatformError
from console import services
from console.team_viewers import may_view_team, viewer_team_ids
from models_registry.models import Model
from rollouts.traffic_scope import traffic_scope

# Where Debian's libjs-chart.js lands under STATIC_URL (config.settings).
CHARTJS = "vendor/chartjs/chart.min.js"
# Days of usage the team pages sum.
TEAM_DAYS = 7
# How often the pool page asks for its feed.
REFRESH_MS = 2000


def _nav(request: HttpRequest) -> dict[str, Any]:
    """Return which of the console's pages the user may open (its nav links)."""
    user = request.user
    return {
        "reports_url": reverse("console-reports"),
        "show_fleet_nav": user.has_perm("engine_nodes.view_replica"),
        "show_rollouts": user.has_perm("rollouts.view_rollout"),
        "show_teams": user.has_perm("accounts.view_team")
        or bool(viewer_team_ids(user)),
        "show_reports": user.has_perm("metering.view_cost_report"),
        "show_judge_labels": user.has_perm("models_registry.change_judgeitem"),
    }


def _context(request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
    return {
        **admin.site.each_context(request),
        **_nav(request),
        "title": title,
        "has_chartjs": finders.find(CHARTJS) is not None,
        "chartjs": CHARTJS,
        **extra,
    }


def _require(request: HttpRequest, perm: str) -> None:
    if not request.user.has_perm(perm):
        raise PermissionDenied(f"needs {perm}")


@never_cache
def home(request: HttpRequest) -> HttpResponse:
    """The admin's index with the fleet at a glance above the list of tables;
    ``?format=json`` is the feed its script reads to refresh the fleet's figures."""
    extra = _nav(request)
    extra["show_fleet"] = extra["show_fleet_nav"]
    sees = services.Sees(
        rollouts=request.user.has_perm("rollouts.view_rollout"),
        batches=request.user.has_perm("batches.view_batch"),
    )
    if request.GET.get("format") == "json":
        _require(request, "engine_nodes.view_replica")
        return JsonResponse(services.fleet_feed(now=timezone.now(), sees=sees))
    if extra["show_fleet"]:
        now = timezone.now()
        extra.update(services.fleet_overview(now=now, sees=sees))
        extra["refresh_ms"] = REFRESH_MS
        extra["refreshed_at"] = now.isoformat()
    return admin.site.index(request, extra_context=extra)


@never_cache
def pool(request: HttpRequest, model: str, version: str, region: str) -> HttpResponse:
    """A pool's replicas, load, queue, hit rate and decisions; ``?format=json`` is
    the feed the page's script reads every ``REFRESH_MS``."""
    _require(request, "engine_nodes.view_replica")
    try:
        feed = services.pool_feed(
            model_id=model, version=version, region=region, now=timezone.now()
        )
    except NotFound as exc:
        raise Http404(exc.message) from None
    if request.GET.get("format") == "json":
        return JsonResponse(feed)
    return TemplateResponse(
        request,
        "console/pool.html",
        _context(
            request,
            f"Pool {model}@{version} in {region}",
            pool=feed,
            refresh_ms=REFRESH_MS,
            feed_url=f"{request.path}?format=json",
        ),
    )


def rollouts(request: HttpRequest) -> HttpResponse:
    """Every model with its running rollout, if any."""
    _require(request, "rollouts.view_rollout")
    running = {r.model_id: r for r in services.open_rollouts()}
    rows = [
        {
            "model": m,
            "rollout": running.get(m.model),
            "state": services.rollout_state(running[m.model])
            if m.model in running
            else None,
        }
        for m in Model.objects.select_related("live_version").order_by("model")
    ]
    return TemplateResponse(
        request, "console/rollouts.html", _context(request, "Rollouts", rows=rows)
    )


@require_http_methods(["GET", "POST"])
def rollout(request: HttpRequest, model: str) -> HttpResponse:
    """A model's rollout: stage, state, guard readings; POST starts or controls it."""
    _require(request, "rollouts.view_rollout")
    if request.method == "POST":
        return _act(request, model)
    try:
        page = services.rollout_page(model)
    except NotFound as exc:
        raise Http404(exc.message) from None
    return TemplateResponse(
        request,
        "console/rollout.html",
        _context(
            request,
            f"Rollout of {model}",
            can_change=request.user.has_perm("rollouts.change_rollout"),
            actions=list(services.ACTIONS),
            **page,
        ),
    )


@permission_required("rollouts.change_rollout", raise_exception=True)
def _act(request: HttpRequest, model: str) -> HttpResponse:
    action = request.POST.get("action", "")
    now = timezone.now()
    with audited(request, source=Source.CONSOLE, scope=traffic_scope(model)):
        _act_on(request, model, action, now)
    return redirect("console-rollout", model=model)


def _act_on(request: HttpRequest, model: str, action: str, now: datetime) -> None:
    try:
        if action == "start":
            version = request.POST.get("version", "")
            if not version:
                raise PlatformError("choose a version to start", param="version")
            started = services.start_rollout(model_id=model, version=version, now=now)
            messages.success(
                request,
                f"Started {started.version.version} at {started.stage} {started.percent:g}%.",
            )
        elif action in services.ACTIONS:
            done = services.control_rollout(
                model_id=model, action=action, by=admin_name(request), now=now
            )
            messages.success(
                request, f"{action}: {done.version.version}: {done.reason}"
            )
        else:
            messages.error(request, f"unknown action {action!r}")
    except PlatformError as exc:
        messages.error(request, f"{action} refused: {exc.message}")


def teams(request: HttpRequest) -> HttpResponse:
    """Every team's usage over the last ``TEAM_DAYS`` days, per model; a team's
    viewer sees only the teams it views."""
    own: frozenset[str] | None = None
    if not request.user.has_perm("accounts.view_team"):
        own = viewer_team_ids(request.user)
        if not own:
            raise PermissionDenied("needs accounts.view_team")
    since = timezone.now() - timedelta(days=TEAM_DAYS)
    listed = Team.objects.order_by("team")
    return TemplateResponse(
        request,
        "console/teams.html",
        _context(
            request,
            f"Teams: usage of the last {TEAM_DAYS} days",
            rows=services.team_usage(since=since, team_ids=own),
            teams=listed if own is None else listed.filter(team__in=own),
            days=TEAM_DAYS,
        ),
    )


def team(request: HttpRequest, team: str) -> HttpResponse:
    """One team's usage per model and day over the last ``TEAM_DAYS`` days, and
    its keys' metadata. Another team than a viewer's own is a 403, whether or not
    it exists (the answer tells nothing of other teams)."""
    if not may_view_team(request.user, team):
        raise PermissionDenied(f"needs accounts.view_team on {team}")
    found = Team.objects.filter(pk=team).first()
    if found is None:
        raise Http404(f"no team {team!r}")
    since = timezone.now() - timedelta(days=TEAM_DAYS)
    return TemplateResponse(
        request,
        "console/team.html",
        _context(
            request,
            f"Team {found.team}: usage of the last {TEAM_DAYS} days",
            team=found,
            totals=services.team_usage(since=since, team_id=found.team),
            rows=services.team_usage(since=since, team_id=found.team, by_day=True),
            keys=services.team_keys(team_id=found.team),
            can_edit_team=request.user.has_perm("accounts.view_team"),
            budgets=services.team_budgets(team_id=found.team, now=timezone.now()),
            days=TEAM_DAYS,
        ),
    )
