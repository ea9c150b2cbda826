"""The console's own pages: the fleet at a glance, the live pool page and its feed,
rollouts with their controls, teams' usage, and who may see what."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.staticfiles import finders
from django.db.models import Model as DjangoModel
from django.test import Client, RequestFactory
from django.urls import reverse
from django.utils import timezone

from accounts.models import Team
from batches.models import Batch
from engine_nodes.models import Node, Replica, ScalingDecision
from metering.domain.figures import TTFT_BOUNDS_S
from metering.models import ReplicaSpan, Usage, VersionFigure
from models_registry import services as registry_services
from models_registry.models import GateRun, Model, ModelVersion, Pool, VersionRegion
from rollouts import services as rollout_services
from rollouts.models import GuardEvaluation, Rollout, VersionOverride
from tests.factories import ReplicaFactory, accept, digest, version_body

pytestmark = pytest.mark.django_db

POOL_URL = "/console/fleet/pools/chat-7b/v1/local/"


def client_with(*perms: str, superuser: bool = False) -> Client:
    """Return a client logged in as a staff user holding ``perms`` (app.codename)."""
    users = get_user_model().objects
    name = f"user{users.count()}"
    if superuser:
        user = users.create_superuser(username=name, email="", password=None)
    else:
        user = users.create_user(username=name, password=None, is_staff=True)
        for perm in perms:
            app_label, codename = perm.split(".")
            user.user_permissions.add(
                Permission.objects.get(
                    content_type__app_label=app_label, codename=codename
                )
            )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def console(db: None) -> Client:
    return client_with(superuser=True)


@pytest.fixture
def pool(chat_v1: ModelVersion) -> Pool:
    """Return chat-7b@v1's pool in ``local`` with two serving replicas that beat."""
    found = Pool.objects.create(
        model=chat_v1.model,
        version=chat_v1,
        region="local",
        max_replicas=5,
        desired_replicas=3,
    )
    now = timezone.now()
    ReplicaFactory.create(
        replica_id="r-a",
        version=chat_v1,
        last_heartbeat=now,
        tokens_in_flight=1_000,
        queue_depth=2,
    )
    ReplicaFactory.create(
        replica_id="r-b",
        version=chat_v1,
        last_heartbeat=now,
        tokens_in_flight=500,
        queue_depth=1,
    )
    return found


def clear_finders() -> None:
    """Forget the static files finders, which are cached with the settings they
    were built from."""
    finders.get_finder.cache_clear()  # type: ignore[attr-defined]


def feed(client: Client) -> dict[str, Any]:
    response = client.get(POOL_URL, {"format": "json"})
    assert response.status_code == 200, response.content[:500]
    assert response["Content-Type"] == "application/json"
    data: dict[str, Any] = response.json()
    return data


# --- the pool page and its feed -----------------------------------------------------


def test_pool_feed_sums_the_pools_serving_replicas_and_changes_with_their_load(
    console: Client, pool: Pool
) -> None:
    before = feed(console)

    assert before["pool"] == "chat-7b/v1/local"
    assert before["serving_replicas"] == 2
    assert before["desired_replicas"] == 3
    assert before["tokens_in_flight"] == 1_500
    assert before["queue_depth"] == 3
    capacity = before["capacity_tokens_in_flight"]
    assert capacity > 0
    assert before["utilisation"] == pytest.approx(1_500 / capacity)
    assert {r["replica_id"]: r["state"] for r in before["replicas"]} == {
        "r-a": "serving",
        "r-b": "serving",
    }

    # A heartbeat moves one replica's load; another one falls silent.
    Replica.objects.filter(pk="r-a").update(tokens_in_flight=4_000, queue_depth=7)
    Replica.objects.filter(pk="r-b").update(
        last_heartbeat=timezone.now() - timedelta(hours=1)
    )
    after = feed(console)

    assert after["tokens_in_flight"] == 4_000
    assert after["queue_depth"] == 7
    assert after["serving_replicas"] == 1
    assert after["refreshed_at"] != before["refreshed_at"]
    silent = {r["replica_id"]: r["is_silent"] for r in after["replicas"]}
    assert silent == {"r-a": False, "r-b": True}


def test_pool_feed_reads_its_pools_live_figures_and_decisions(
    console: Client, pool: Pool, team: Team, chat_v1: ModelVersion
) -> None:
    """Hit rate and TTFT are the pool's own live figures (role ``pool``, written
    with no rollout running), not the minute usage rows nor the guards'."""
    now = timezone.now()
    Usage.objects.create(
        team=team,
        model=chat_v1.model,
        version=chat_v1,
        minute=now.replace(second=0, microsecond=0),
        prompt_tokens=1_200,
        cached_tokens=100,
        requests=2,
    )
    VersionFigure.objects.create(
        model=chat_v1.model,
        version="v1",
        role="pool",
        region="local",
        bucket_start=now - timedelta(seconds=30),
        bucket_s=60,
        requests=20,
        answered=20,
        prompt_tokens=1_200,
        cached_tokens=800,
        ttft={"10": 19, "40": 1},
    )
    # Another region's pool, and the guards' figures, are not this pool's.
    for role, region in (("pool", "elsewhere"), ("live", "local")):
        VersionFigure.objects.create(
            model=chat_v1.model,
            version="v1",
            role=role,
            region=region,
            bucket_start=now - timedelta(seconds=30),
            bucket_s=60,
            requests=5,
            answered=5,
            prompt_tokens=100,
            ttft={"60": 5},
        )
    ScalingDecision.objects.create(
        pool=pool,
        region="local",
        decided_at=now,
        from_replicas=2,
        to_replicas=3,
        reason="utilisation",
        utilisation=0.9,
    )

    data = feed(console)

    assert data["prefix_hit_rate"] == pytest.approx(800 / 1_200)
    # 19 of 20 first tokens in bucket 10: the 95th percentile is bucket 10's bound.
    assert data["ttft_p95_ms"] == pytest.approx(TTFT_BOUNDS_S[10] * 1000, abs=0.1)
    assert [(d["from_replicas"], d["to_replicas"]) for d in data["decisions"]] == [
        (2, 3)
    ]


def test_pool_page_has_the_fields_the_script_refreshes(
    console: Client, pool: Pool
) -> None:
    response = console.get(POOL_URL)

    assert response.status_code == 200
    body = response.content.decode()
    assert 'id="pool"' in body
    assert f'data-feed-url="{POOL_URL}?format=json"' in body
    assert "data-refreshed-at=" in body
    for name in (
        "tokens_in_flight",
        "capacity_tokens_in_flight",
        "queue_depth",
        "serving_replicas",
        "prefix_hit_rate",
        "ttft_p95_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "router_tokens_in_flight",
        "router_utilisation",
        "usd_per_million_tokens",
    ):
        assert f'data-field="{name}"' in body
    assert 'data-replica="r-a"' in body
    assert 'id="decisions"' in body
    assert '<canvas id="pool-chart"' in body
    assert "console/pool.js" in body


def test_pool_page_of_an_unknown_pool_is_404(console: Client, pool: Pool) -> None:
    assert console.get("/console/fleet/pools/chat-7b/v9/local/").status_code == 404
    assert console.get("/console/fleet/pools/nope/v1/local/").status_code == 404


def test_pool_script_and_chart_library_are_served_from_static_files() -> None:
    assert finders.find("console/pool.js") is not None
    debian = Path("/usr/share/javascript/chart.js/chart.min.js")
    # Served from Debian's package where it is installed; the page works without.
    assert (finders.find("vendor/chartjs/chart.min.js") is not None) == (
        debian.is_file()
    )


def test_pool_page_loads_chart_js_only_when_it_is_installed(
    console: Client, pool: Pool, settings: Any
) -> None:
    with_chart = console.get(POOL_URL).content.decode()
    settings.STATICFILES_DIRS = []
    clear_finders()
    try:
        without = console.get(POOL_URL).content.decode()
    finally:
        clear_finders()

    assert "vendor/chartjs/chart.min.js" not in without
    assert 'id="no-chart"' in without
    assert "console/pool.js" in without
    if Path("/usr/share/javascript/chart.js").is_dir():
        assert "vendor/chartjs/chart.min.js" in with_chart


# --- the home page -------------------------------------------------------------------


def test_home_shows_each_pool_and_what_is_alerting(
    console: Client, pool: Pool, chat_v1: ModelVersion, team: Team
) -> None:
    Replica.objects.filter(pk="r-b").update(last_heartbeat=None)
    Batch.objects.create(
        id="batch_1",
        team=team,
        model=chat_v1.model,
        completion_window="24h",
        status=Batch.Status.IN_PROGRESS,
        created_at=timezone.now(),
        deadline_at=timezone.now() + timedelta(hours=1),
        at_risk=True,
        schedule_reason="needs 2 h at the rate seen",
    )
    rollout_services.set_rollout(
        model_id="chat-7b",
        version="v1",
        stage="canary",
        percent=5,
        now=timezone.now(),
    )

    response = console.get("/console/")

    assert response.status_code == 200
    body = response.content.decode()
    assert 'id="fleet"' in body
    assert 'data-pool="chat-7b/v1/local"' in body
    assert 'data-field="serving_replicas" data-value="1"' in body
    assert 'data-field="desired_replicas" data-value="3"' in body
    assert 'id="rollouts"' in body
    assert 'id="alerts"' in body
    kinds = {(a["kind"], a["subject"]) for a in response.context["alerts"]}
    assert ("replica_silent", "r-b") in kinds
    assert ("batch_at_risk", "batch_1") in kinds
    assert [r.model_id for r in response.context["rollouts"]] == ["chat-7b"]
    # The tables are still listed, under their human names.
    for name in ("Fleet", "Models", "Usage and cost", "Traffic and rollouts"):
        assert name in body
    assert "Engine_nodes" not in body and "ENGINE_NODES" not in body


def test_home_feed_carries_each_pools_cells_and_follows_their_load(
    console: Client, pool: Pool
) -> None:
    def fleet() -> dict[str, Any]:
        response = console.get("/console/", {"format": "json"})
        assert response.status_code == 200
        data: dict[str, Any] = response.json()
        return data

    before = fleet()
    Replica.objects.filter(pk="r-a").update(tokens_in_flight=9_000, queue_depth=4)
    Replica.objects.filter(pk="r-b").update(last_heartbeat=None)
    after = fleet()

    (row,) = before["pools"]
    assert row["pool"] == "chat-7b/v1/local"
    for name in (
        "serving_replicas",
        "desired_replicas",
        "utilisation",
        "queue_depth",
        "ttft_p95_ms",
        "prefix_hit_rate",
    ):
        assert name in row
    assert (row["tokens_in_flight"], row["queue_depth"]) == (1_500, 3)
    (moved,) = after["pools"]
    assert (moved["tokens_in_flight"], moved["queue_depth"]) == (9_000, 4)
    assert moved["serving_replicas"] == 1
    assert ("replica_silent", "r-b") in {
        (a["kind"], a["subject"]) for a in after["alerts"]
    }
    assert after["refreshed_at"] != before["refreshed_at"]


def test_home_feed_needs_the_replica_permission(pool: Pool) -> None:
    client = client_with("metering.view_usage")
    assert client.get("/console/", {"format": "json"}).status_code == 403


def test_home_hides_the_fleet_from_users_who_may_not_see_replicas(db: None) -> None:
    client = client_with("metering.view_usage")

    response = client.get("/console/")

    assert response.status_code == 200
    body = response.content.decode()
    assert 'id="fleet"' not in body
    assert "pools" not in response.context


def test_home_links_reports_for_finance(db: None) -> None:
    client = client_with("metering.view_cost_report", "metering.view_usage")

    body = client.get("/console/").content.decode()

    assert 'href="/console/reports/"' in body
    assert 'id="fleet"' not in body
    assert 'data-nav="rollouts"' not in body


# --- who may see what ---------------------------------------------------------------

PAGES = [
    (POOL_URL, "engine_nodes.view_replica"),
    ("/console/rollouts/", "rollouts.view_rollout"),
    ("/console/rollouts/chat-7b/", "rollouts.view_rollout"),
    ("/console/teams/", "accounts.view_team"),
    ("/console/teams/search/", "accounts.view_team"),
]


@pytest.mark.parametrize(("path", "perm"), PAGES)
def test_console_page_renders_for_an_admin(
    console: Client, pool: Pool, team: Team, path: str, perm: str
) -> None:
    assert console.get(path).status_code == 200


@pytest.mark.parametrize(("path", "perm"), PAGES)
def test_console_page_sends_anonymous_users_to_login(
    pool: Pool, team: Team, path: str, perm: str
) -> None:
    response = Client().get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/console/login/")


@pytest.mark.parametrize(("path", "perm"), PAGES)
def test_console_page_needs_its_view_permission(
    pool: Pool, team: Team, path: str, perm: str
) -> None:
    others = {p for _, p in PAGES} - {perm}
    assert client_with(*others).get(path).status_code == 403
    assert client_with(perm).get(path).status_code == 200


def test_pool_feed_needs_the_replica_permission(pool: Pool) -> None:
    response = client_with("rollouts.view_rollout").get(POOL_URL, {"format": "json"})
    assert response.status_code == 403


# --- rollouts -------------------------------------------------------------------------


@pytest.fixture
def v2(chat_v1: ModelVersion) -> ModelVersion:
    """Return chat-7b@v2, ready, with v1 live."""
    rollout_services.set_alias(model_id="chat-7b", version="v1")
    return accept(
        registry_services.register_version(
            model_id="chat-7b", **version_body(weights_hash=digest("v2"))
        )
    )


def rollout_url(model: str = "chat-7b") -> str:
    return reverse("console-rollout", kwargs={"model": model})


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def test_rollout_start_and_rollback_go_through_the_services(
    console: Client, v2: ModelVersion
) -> None:
    page = console.get(rollout_url())
    assert [v.version for v in page.context["startable"]] == ["v2"]

    started = console.post(
        rollout_url(), {"action": "start", "version": "v2"}, follow=True
    )

    assert started.redirect_chain[-1] == (rollout_url(), 302)
    rollout = Rollout.objects.get(decision="pending")
    assert rollout.version_id == v2.pk
    assert rollout.plan is not None
    assert any("Started v2" in m for m in messages_of(started))
    body = started.content.decode()
    assert 'data-field="stage"' in body
    assert 'data-field="state">running<' in body
    assert 'value="rollback"' in body

    paused = console.post(rollout_url(), {"action": "pause"}, follow=True)
    rollout.refresh_from_db()
    assert rollout.paused
    assert 'data-field="state">paused<' in paused.content.decode()

    rolled_back = console.post(rollout_url(), {"action": "rollback"}, follow=True)

    rollout.refresh_from_db()
    assert rollout.decision == "aborted"
    model = Model.objects.get(pk="chat-7b")
    assert model.canary_version_id is None
    assert model.live_version is not None
    assert model.live_version.version == "v1"
    assert any("rollback" in m for m in messages_of(rolled_back))


@pytest.mark.parametrize(
    ("form", "refusal"),
    [
        ({"action": "start", "version": "v1"}, "already live"),
        ({"action": "start", "version": "v404"}, "refused"),
        ({"action": "start", "version": ""}, "choose a version"),
        ({"action": "advance"}, "no rollout running"),
        ({"action": "rollback"}, "no rollout running"),
        ({"action": "explode"}, "unknown action"),
    ],
)
def test_rollout_refusals_are_messages_not_errors(
    console: Client, v2: ModelVersion, form: dict[str, str], refusal: str
) -> None:
    response = console.post(rollout_url(), form, follow=True)

    assert response.status_code == 200
    shown = messages_of(response)
    assert any(refusal in m for m in shown), shown
    assert not Rollout.objects.exists()


def test_rollout_on_a_stage_set_by_hand_refuses_pause_with_a_message(
    console: Client, v2: ModelVersion
) -> None:
    rollout_services.set_rollout(
        model_id="chat-7b", version="v2", stage="canary", percent=5, now=timezone.now()
    )

    response = console.post(rollout_url(), {"action": "pause"}, follow=True)

    assert any("has no plan" in m for m in messages_of(response))
    assert not Rollout.objects.get().paused


def test_rollout_actions_need_the_change_permission(v2: ModelVersion) -> None:
    viewer = client_with("rollouts.view_rollout")

    page = viewer.get(rollout_url()).content.decode()
    refused = viewer.post(rollout_url(), {"action": "start", "version": "v2"})

    assert 'value="start"' not in page
    assert refused.status_code == 403
    assert not Rollout.objects.exists()


def test_rollout_actions_need_the_csrf_token(v2: ModelVersion) -> None:
    user = get_user_model().objects.create_superuser(
        username="csrf", email="", password=None
    )
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)

    response = client.post(rollout_url(), {"action": "start", "version": "v2"})

    assert response.status_code == 403
    assert not Rollout.objects.exists()


def test_rollout_page_shows_the_guards_evaluations(
    console: Client, v2: ModelVersion
) -> None:
    console.post(rollout_url(), {"action": "start", "version": "v2"})
    rollout = Rollout.objects.get()
    GuardEvaluation.objects.create(
        rollout=rollout,
        at=timezone.now(),
        step=0,
        stage=rollout.stage,
        percent=rollout.percent,
        action="continue",
        reason="ttft p95 within 20% of the live version",
    )

    body = console.get(rollout_url()).content.decode()

    assert 'id="guards"' in body
    assert "ttft p95 within 20% of the live version" in body


def test_rollouts_list_shows_each_model_and_its_running_rollout(
    console: Client, v2: ModelVersion
) -> None:
    registry_services.create_model(model_id="code-13b")
    console.post(rollout_url(), {"action": "start", "version": "v2"})

    response = console.get(reverse("console-rollouts"))

    rows = {r["model"].model: r["state"] for r in response.context["rows"]}
    assert rows == {"chat-7b": "running", "code-13b": None}


# --- teams -----------------------------------------------------------------------------


def test_team_pages_sum_usage_429s_and_shed_per_model(
    console: Client, team: Team, chat_v1: ModelVersion
) -> None:
    now = timezone.now().replace(second=0, microsecond=0)
    for minutes, (prompt, output, limited, shed) in enumerate(
        [(100, 10, 1, 0), (200, 20, 0, 2)]
    ):
        Usage.objects.create(
            team=team,
            model=chat_v1.model,
            version=chat_v1,
            minute=now - timedelta(minutes=minutes),
            prompt_tokens=prompt,
            output_tokens=output,
            requests=1,
            rate_limited=limited,
            shed=shed,
        )
    # Older than the pages' window: left out.
    Usage.objects.create(
        team=team,
        model=chat_v1.model,
        version=chat_v1,
        minute=now - timedelta(days=30),
        prompt_tokens=9_999,
        requests=5,
    )

    listed = console.get(reverse("console-teams")).context["rows"]
    detail = console.get(reverse("console-team", kwargs={"team": "search"}))

    expected = {
        "team_id": "search",
        "model_id": "chat-7b",
        "requests": 2,
        "tokens": 330,
        "rate_limited": 1,
        "shed": 2,
    }
    assert [{k: row[k] for k in expected} for row in listed] == [expected]
    totals = detail.context["totals"]
    assert [{k: row[k] for k in expected} for row in totals] == [expected]
    assert sum(row["requests"] for row in detail.context["rows"]) == 2
    assert 'data-field="rate_limited">1<' in detail.content.decode()


def test_team_page_of_an_unknown_team_is_404(console: Client) -> None:
    assert console.get("/console/teams/nobody/").status_code == 404


# --- what the system owns is read-only -------------------------------------------------

SYSTEM_OWNED: list[type[DjangoModel]] = [
    ReplicaSpan,
    Replica,
    Node,
    ScalingDecision,
    Usage,
    VersionFigure,
    GuardEvaluation,
    GateRun,
    VersionRegion,
    VersionOverride,
]


@pytest.mark.parametrize("model", SYSTEM_OWNED, ids=lambda m: m.__name__)
def test_system_owned_rows_cannot_be_added_changed_or_deleted(
    db: None, model: type[DjangoModel]
) -> None:
    request = RequestFactory().get("/console/")
    request.user = get_user_model().objects.create_superuser(
        username="root", email="", password=None
    )
    model_admin = admin.site._registry[model]

    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request)
    assert not model_admin.has_delete_permission(request)
    assert model_admin.has_view_permission(request)


def test_replicas_page_offers_no_add_replica(console: Client, pool: Pool) -> None:
    body = console.get(reverse("admin:engine_nodes_replica_changelist")).content
    assert b"Add replica" not in body
    assert b"r-a" in body


def test_chart_js_directory_is_a_static_files_directory_only_when_present() -> None:
    dirs = [str(path) for _, path in settings.STATICFILES_DIRS]
    assert ("/usr/share/javascript/chart.js" in dirs) == Path(
        "/usr/share/javascript/chart.js"
    ).is_dir()


def test_admin_pages_under_rollouts_keep_their_paths(console: Client) -> None:
    changelist = reverse("admin:rollouts_rollout_changelist")

    response = console.get(changelist)

    assert changelist == "/console/rollouts/rollout/"
    assert response.status_code == 200
    assert response.context["cl"].model is Rollout


def test_the_fleet_shows_rollouts_and_batches_only_to_who_may_see_them(
    pool: Pool, chat_v1: ModelVersion
) -> None:
    """Seeing replicas opens the fleet, not the rollouts or batches beside it."""
    v2 = accept(
        registry_services.register_version(
            model_id="chat-7b", **version_body(weights_hash=digest("v2-sees"))
        )
    )
    Rollout.objects.create(
        model=chat_v1.model,
        version=v2,
        stage="canary",
        percent=5.0,
        started_at=timezone.now(),
        paused=True,
        reason="paused by a test",
    )
    fleet_only = client_with("engine_nodes.view_replica")
    page = fleet_only.get("/console/").content.decode()
    feed = fleet_only.get("/console/?format=json").json()
    assert 'id="fleet"' in page
    assert 'id="rollouts"' not in page
    assert "paused by a test" not in page
    assert feed["rollouts"] == []
    assert not [a for a in feed["alerts"] if a["kind"].startswith("rollout")]

    both = client_with("engine_nodes.view_replica", "rollouts.view_rollout")
    feed = both.get("/console/?format=json").json()
    assert [r["version"] for r in feed["rollouts"]] == ["v2"]
    assert "paused by a test" in both.get("/console/").content.decode()


def test_the_rollout_page_lists_each_guard_with_the_judges_agreement(
    console: Client, v2: ModelVersion
) -> None:
    """The last evaluation's guards, the judge's among them with its verdict and
    the sentence on its agreement with people."""
    rollout_services.set_rollout(
        model_id="chat-7b", version="v2", stage="canary", percent=5, now=timezone.now()
    )
    agreement = "the judge judge-7b@v1 cannot gate: Cohen's kappa 0.20"
    Rollout.objects.update(
        guard_metrics={
            "results": [
                {
                    "name": "error_rate",
                    "verdict": "not_worse",
                    "candidate": 0.004,
                    "live": 0.005,
                    "lower": -0.3,
                    "upper": 0.2,
                    "reason": "error rate: not worse",
                },
                {
                    "name": "judge_win_rate",
                    "verdict": "off",
                    "candidate": 0.31,
                    "live": 0.5,
                    "lower": 0.25,
                    "upper": 0.37,
                    "reason": f"judge win rate 0.310: off; {agreement}",
                },
            ]
        }
    )

    body = console.get(rollout_url()).content.decode()

    assert 'data-guard="error_rate"' in body
    judge_row = body.split('data-guard="judge_win_rate"', 1)[1].split("</tr>", 1)[0]
    assert 'data-col="verdict">off<' in judge_row
    assert "0.250 to 0.370" in judge_row
    assert "kappa 0.20" in judge_row
