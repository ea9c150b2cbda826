"""The admin console at /console/: every table's pages, secrets shown once, and
versions registered through the same service as the REST API."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Model as DjangoModel
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from accounts import services as accounts_services
from accounts.domain.keys import hash_secret
from accounts.models import (
    AdminToken,
    ApiKey,
    RegionDemand,
    Team,
    TeamBudget,
    TeamEntitlement,
    TeamLimit,
)
from engine_nodes import services as node_services
from engine_nodes.models import Node, Replica, ScalingDecision
from metering.models import ReplicaSpan, Usage, VersionFigure
from models_registry import services as registry_services
from models_registry.domain.identity import sha256_text
from models_registry.models import (
    EvalSet,
    GateRun,
    JudgeItem,
    Model,
    ModelVersion,
    Pool,
    PoolSchedule,
    VersionRegion,
)
from rollouts import services as rollout_services
from rollouts.models import GuardEvaluation, Rollout, VersionOverride
from tests.factories import (
    ReplicaFactory,
    TeamFactory,
    accept,
    digest,
    version_body,
)

if TYPE_CHECKING:
    from django.test.client import _MonkeyPatchedWSGIResponse as ConsoleResponse

CONSOLE_MODELS: list[type[DjangoModel]] = [
    Team,
    TeamLimit,
    TeamEntitlement,
    TeamBudget,
    ApiKey,
    AdminToken,
    Model,
    ModelVersion,
    Pool,
    PoolSchedule,
    Replica,
    Node,
    ScalingDecision,
    Usage,
    Rollout,
    GateRun,
    JudgeItem,
    VersionRegion,
    EvalSet,
    VersionOverride,
    VersionFigure,
    GuardEvaluation,
    ReplicaSpan,
    RegionDemand,
]
# Usage is written by the gateway's flush only, nodes and replicas by their agents,
# decisions by the autoscaler, gate runs and region copies by the gates, overrides
# by the traffic changes they allowed, and schedule rows on their pool's page; the
# console may not add rows.
NO_ADD_PAGE = {
    RegionDemand,
    Replica,
    ReplicaSpan,
    Usage,
    VersionFigure,
    GuardEvaluation,
    Node,
    ScalingDecision,
    PoolSchedule,
    GateRun,
    JudgeItem,
    VersionRegion,
    VersionOverride,
}
TEAM_SECRET = re.compile(r"sk-team-[A-Za-z0-9_-]{43}")
ADMIN_SECRET = re.compile(r"sk-admin-[A-Za-z0-9_-]{43}")


def url(model: type[DjangoModel], view: str, *args: Any) -> str:
    """Return the console URL of ``view`` (changelist, add, change) for ``model``."""
    opts = model._meta
    return reverse(
        f"admin:{opts.app_label}_{opts.model_name}_{view}",
        args=[quote(a) for a in args],
    )


def minute_ago(minutes: int = 0) -> datetime:
    """Return a minute-truncated instant, as Usage rows require."""
    now = timezone.now().replace(second=0, microsecond=0)
    return now - timedelta(minutes=minutes)


@pytest.fixture
def console(db: None) -> Client:
    """Return a client logged in to the console as a superuser."""
    user = get_user_model().objects.create_superuser(
        username="operator", email="operator@example.com", password=None
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def rows(team: Team, chat_v1: ModelVersion) -> dict[type[DjangoModel], DjangoModel]:
    """Return one existing row of every console model, made through services."""
    limit, _ = accounts_services.set_team_limit(
        team_id=team.team,
        model_id=chat_v1.model_id,
        tokens_per_minute=60_000,
        max_concurrency=8,
        guaranteed_share=0.25,
    )
    key, _ = accounts_services.issue_key(team_id=team.team, name="ci")
    token, _ = accounts_services.create_admin_token(name="ops")
    pool = Pool.objects.create(model=chat_v1.model, version=chat_v1, region="local")
    schedule = PoolSchedule.objects.create(
        pool=pool, weekdays=[0, 1], start_minute=510, end_minute=600, min_replicas=1
    )
    decision = ScalingDecision.objects.create(
        pool=pool,
        region="local",
        decided_at=timezone.now(),
        from_replicas=1,
        to_replicas=1,
        reason="hold",
    )
    replica = ReplicaFactory.create(version=chat_v1)
    node, _ = node_services.record_node_beat(
        node="node-1",
        region="local",
        gpus=8,
        now=timezone.now(),
        warm_version_ids=[chat_v1.pk],
    )
    usage = Usage.objects.create(
        team=team,
        model=chat_v1.model,
        version=chat_v1,
        minute=minute_ago(),
        prompt_tokens=1_200,
        cached_tokens=800,
        output_tokens=150,
        requests=1,
    )
    rollout = rollout_services.set_rollout(
        model_id=chat_v1.model_id,
        version=chat_v1.version,
        stage="canary",
        percent=1.0,
        now=timezone.now(),
    )
    # Registration queued one row per gate; the fixture keeps one of them.
    gate_run = GateRun.objects.filter(version=chat_v1).order_by("id").first()
    assert gate_run is not None
    GateRun.objects.filter(version=chat_v1).exclude(pk=gate_run.pk).delete()
    region_copy = VersionRegion.objects.create(
        version=chat_v1, region="local", uri=chat_v1.weights_uri, state="ready"
    )
    eval_set = EvalSet.objects.create(
        model=chat_v1.model, team=team, uri="s3://models/evals/search.jsonl"
    )
    override = VersionOverride.objects.create(
        model=chat_v1.model,
        version=chat_v1,
        action="rollout",
        stage="canary",
        percent=1.0,
        version_status="evaluating",
        refusal="chat-7b@v1 is still evaluating: it is not ready yet",
        by="console user ops",
        reason="the eval set is being rebuilt",
        at=timezone.now(),
    )
    figure = VersionFigure.objects.create(
        model=chat_v1.model,
        version=chat_v1.version,
        role="canary",
        region="local",
        bucket_start=minute_ago(),
        bucket_s=60,
        requests=3,
        answered=3,
        refusals=1,
        output_tokens=90,
        conversations=2,
        errors={},
        ttft={"40": 3},
        output={"40": 3},
    )
    evaluation = GuardEvaluation.objects.create(
        rollout=rollout,
        at=timezone.now(),
        step=0,
        stage="canary",
        percent=1.0,
        action="continue",
        reason="the step has run 5 s of its 600 s",
    )
    return {
        Team: team,
        TeamLimit: limit,
        TeamEntitlement: accounts_services.set_team_entitlement(
            team_id=team.team, model_id=chat_v1.model_id, tiers=["standard"]
        )[0],
        TeamBudget: accounts_services.set_team_budget(
            team_id=team.team, model_id=None, monthly_usd=100.0
        )[0],
        ApiKey: key,
        AdminToken: token,
        Model: chat_v1.model,
        ModelVersion: chat_v1,
        Pool: pool,
        PoolSchedule: schedule,
        Replica: replica,
        ScalingDecision: decision,
        Node: node,
        Usage: usage,
        Rollout: rollout,
        GateRun: gate_run,
        JudgeItem: JudgeItem.objects.create(
            gate_run=gate_run,
            judge="reason-70b@v1",
            judge_prompt="judge-v1",
            candidate="chat-7b@v2",
            live="chat-7b@v1",
            eval_set="file:///evals/default.jsonl",
            item_id="maths-1",
            question=[{"role": "user", "content": "2 + 2?"}],
            answer_a="4",
            answer_b="5",
            candidate_side="a",
            judge_verdict="candidate",
        ),
        VersionRegion: region_copy,
        EvalSet: eval_set,
        VersionOverride: override,
        VersionFigure: figure,
        GuardEvaluation: evaluation,
        # The replica's first state, written as it was created.
        ReplicaSpan: ReplicaSpan.objects.get(replica_id=replica.replica_id),
        RegionDemand: RegionDemand.objects.create(
            region="local",
            limit_key=f"{team.team}:{chat_v1.model_id}",
            demand_tokens=1200,
            window_s=30.0,
            heard_at=timezone.now(),
        ),
    }


def test_console_registers_every_model_of_the_platform_apps() -> None:
    app_labels = {m._meta.app_label for m in CONSOLE_MODELS}
    models = {
        m for label in app_labels for m in apps.get_app_config(label).get_models()
    }
    assert models == set(CONSOLE_MODELS)
    assert not models - set(admin.site._registry)


def test_console_site_is_titled() -> None:
    assert admin.site.site_header == "Serving platform console"
    assert admin.site.site_title == "Serving platform console"


@pytest.mark.parametrize("model", CONSOLE_MODELS, ids=lambda m: m.__name__)
def test_console_changelist_renders(
    console: Client,
    rows: dict[type[DjangoModel], DjangoModel],
    model: type[DjangoModel],
) -> None:
    response = console.get(url(model, "changelist"))
    assert response.status_code == 200
    assert response.context["cl"].result_count == 1


@pytest.mark.parametrize("model", CONSOLE_MODELS, ids=lambda m: m.__name__)
def test_console_add_page_renders(console: Client, model: type[DjangoModel]) -> None:
    response = console.get(url(model, "add"))
    assert response.status_code == (403 if model in NO_ADD_PAGE else 200)


@pytest.mark.parametrize("model", CONSOLE_MODELS, ids=lambda m: m.__name__)
def test_console_change_page_renders(
    console: Client,
    rows: dict[type[DjangoModel], DjangoModel],
    model: type[DjangoModel],
) -> None:
    row = rows[model]
    response = console.get(url(model, "change", row.pk))
    assert response.status_code == 200
    assert response.context["original"] == row


@pytest.mark.parametrize("model", CONSOLE_MODELS, ids=lambda m: m.__name__)
def test_console_changelist_filters_and_search_render(
    console: Client,
    rows: dict[type[DjangoModel], DjangoModel],
    model: type[DjangoModel],
) -> None:
    model_admin = admin.site._registry[model]
    assert model_admin.search_fields, "every table is searchable"
    response = console.get(url(model, "changelist"), {"q": "no-such-thing-anywhere"})
    assert response.status_code == 200
    assert response.context["cl"].result_count == 0


@pytest.mark.parametrize(
    "path",
    [
        "/console/",
        url(Team, "changelist"),
        url(ApiKey, "add"),
        url(ModelVersion, "add"),
    ],
)
def test_console_redirects_anonymous_users_to_login(db: None, path: str) -> None:
    response = Client().get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/console/login/")


def test_console_refuses_staff_without_permissions(db: None) -> None:
    user = get_user_model().objects.create_user(
        username="viewer", password=None, is_staff=True
    )
    client = Client()
    client.force_login(user)
    assert client.get(url(ApiKey, "add")).status_code == 403


# --- secrets are shown once -------------------------------------------------------


SECRET_CASES = [
    pytest.param(
        ApiKey, {"team": "search", "name": "batch jobs"}, TEAM_SECRET, id="api-key"
    ),
    pytest.param(
        AdminToken,
        {"name": "deploy bot", "scope": "admin"},
        ADMIN_SECRET,
        id="admin-token",
    ),
]


@pytest.mark.parametrize(("model", "form", "pattern"), SECRET_CASES)
def test_console_add_form_asks_only_for_owner_and_name(
    console: Client,
    team: Team,
    model: type[ApiKey | AdminToken],
    form: dict[str, str],
    pattern: re.Pattern[str],
) -> None:
    response = console.get(url(model, "add"))
    fields = set(response.context["adminform"].form.fields)
    assert fields == set(form)
    body = response.content.decode()
    assert 'name="key_hash"' not in body
    assert 'name="prefix"' not in body


@pytest.mark.parametrize(("model", "form", "pattern"), SECRET_CASES)
def test_console_created_secret_is_shown_once_and_stored_hashed(
    console: Client,
    team: Team,
    model: type[ApiKey | AdminToken],
    form: dict[str, str],
    pattern: re.Pattern[str],
) -> None:
    response = console.post(url(model, "add"), form)

    assert response.status_code == 200
    assert response.templates[0].name == "console/secret_created.html"
    body = response.content.decode()
    found = pattern.findall(body)
    assert len(found) == 1, "the secret appears exactly once on the page"
    secret = found[0]
    assert "will not be shown again" in body
    assert "no-store" in response["Cache-Control"]

    stored = model.objects.get()
    assert stored.key_hash == hash_secret(secret)
    assert secret.startswith(stored.prefix)
    assert stored.name == form["name"]
    row_text = " ".join(
        str(getattr(stored, f.attname)) for f in model._meta.concrete_fields
    )
    assert secret not in row_text
    # Nothing else may carry it: not the admin log, messages, session or cookies.
    log = LogEntry.objects.get()
    assert secret not in f"{log.object_repr} {log.change_message}"
    assert secret not in str(dict(console.session.items()))
    assert secret not in str(console.cookies)
    assert list(response.context["messages"]) == []

    change_page = console.get(url(model, "change", stored.pk))
    assert change_page.status_code == 200
    assert secret not in change_page.content.decode()
    assert stored.prefix in change_page.content.decode()


def test_console_api_key_change_page_keeps_secret_fields_read_only(
    console: Client, team: Team
) -> None:
    key, _ = accounts_services.issue_key(team_id=team.team, name="old")
    other = TeamFactory.create()
    original_hash = key.key_hash

    response = console.post(
        url(ApiKey, "change", key.pk),
        {
            "name": "renamed",
            "team": other.team,
            "key_hash": digest("forged"),
            "prefix": "sk-team-XXXX",
            "revoked_at_0": "2030-01-01",
            "revoked_at_1": "00:00:00",
        },
    )

    assert response.status_code == 302
    key.refresh_from_db()
    assert key.name == "renamed"
    assert key.team_id == team.team
    assert key.key_hash == original_hash
    assert key.prefix != "sk-team-XXXX"
    assert key.revoked_at is None


def test_console_team_page_shows_keys_without_their_hashes(
    console: Client, team: Team
) -> None:
    key, secret = accounts_services.issue_key(team_id=team.team, name="ci")

    body = console.get(url(Team, "change", team.pk)).content.decode()

    assert key.prefix in body
    assert key.key_hash not in body
    assert secret not in body


@pytest.mark.parametrize("model", [ApiKey, AdminToken], ids=lambda m: m.__name__)
def test_console_revoke_action_revokes_only_active_secrets(
    console: Client, team: Team, model: type[ApiKey | AdminToken]
) -> None:
    def make(name: str) -> ApiKey | AdminToken:
        if model is ApiKey:
            return accounts_services.issue_key(team_id=team.team, name=name)[0]
        return accounts_services.create_admin_token(name=name)[0]

    active, earlier, untouched = make("active"), make("earlier"), make("untouched")
    first_revocation = timezone.now() - timedelta(days=3)
    model.objects.filter(pk=earlier.pk).update(revoked_at=first_revocation)

    response = console.post(
        url(model, "changelist"),
        {"action": "revoke_selected", "_selected_action": [active.pk, earlier.pk]},
    )

    assert response.status_code == 302
    active.refresh_from_db()
    earlier.refresh_from_db()
    untouched.refresh_from_db()
    assert active.revoked_at is not None
    assert earlier.revoked_at == first_revocation
    assert untouched.revoked_at is None
    assert model.objects.active().count() == 1


# --- model versions -----------------------------------------------------------------


def version_form(**changes: Any) -> dict[str, Any]:
    """Return the console add form for chat-7b with ``changes`` applied."""
    body = version_body(**changes)
    config = body["engine_config"]
    return {
        "model": "chat-7b",
        "version": "",
        "weights_uri": body["weights_uri"],
        "weights_hash": body["weights_hash"],
        "tokenizer_hash": body["tokenizer_hash"],
        "chat_template": body["chat_template"],
        "precision": body["precision"],
        "gpus_per_replica": body["gpus_per_replica"],
        # A string is sent as typed; the example's dict is sent as JSON.
        "engine_config": config if isinstance(config, str) else json.dumps(config),
        "eval_report_uri": "",
    }


def form_errors(response: ConsoleResponse) -> dict[str, list[str]]:
    """Return the add/change form's errors by field ("__all__" for the form)."""
    return dict(response.context["adminform"].form.errors)


def test_console_registers_version_through_the_service(
    console: Client, chat_model: Model
) -> None:
    form = version_form()
    # The service normalizes hashes; the console stores what the API would.
    form["weights_hash"] = form["weights_hash"].upper()

    response = console.post(url(ModelVersion, "add"), form)

    assert response.status_code == 302, form_errors(response)
    version = ModelVersion.objects.get()
    assert version.ref == "chat-7b@v1"
    assert version.chat_template_hash == sha256_text(form["chat_template"])
    assert version.weights_hash == digest("chat-7b weights")
    assert version.engine_config == {"max_num_seqs": 256, "enable_prefix_caching": True}
    assert version.status == "registered"


def test_console_version_label_is_optional_and_honored(
    console: Client, chat_v1: ModelVersion
) -> None:
    form = version_form(weights_hash=digest("other weights"), precision="int8")
    form["version"] = "v7"

    response = console.post(url(ModelVersion, "add"), form)

    assert response.status_code == 302, form_errors(response)
    assert ModelVersion.objects.filter(model_id="chat-7b", version="v7").exists()


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"weights_hash": "not-a-hash"}, "weights_hash", "64"),
        ({"tokenizer_hash": "a" * 63}, "tokenizer_hash", "64"),
        ({"weights_uri": "s3://elsewhere/w/"}, "weights_uri", "storage root"),
        ({"weights_uri": "s3://models/../secrets/"}, "weights_uri", ".."),
        ({"gpus_per_replica": 65}, "gpus_per_replica", "64"),
        ({"engine_config": "[1, 2]"}, "engine_config", "JSON object"),
        ({"chat_template": "   "}, "chat_template", "required"),
    ],
)
def test_console_version_add_refuses_what_the_api_refuses(
    console: Client,
    chat_model: Model,
    changes: dict[str, Any],
    field: str,
    message: str,
) -> None:
    response = console.post(url(ModelVersion, "add"), version_form(**changes))

    assert response.status_code == 200
    errors = form_errors(response)
    assert field in errors
    assert message in " ".join(errors[field])
    assert not ModelVersion.objects.exists()


def test_console_version_add_refuses_a_duplicate_identity(
    console: Client, chat_v1: ModelVersion
) -> None:
    response = console.post(url(ModelVersion, "add"), version_form())

    assert response.status_code == 200
    assert "already registered as chat-7b@v1" in " ".join(
        form_errors(response)["weights_hash"]
    )
    assert ModelVersion.objects.count() == 1


def test_console_version_identity_is_read_only(
    console: Client, chat_v1: ModelVersion
) -> None:
    page = console.get(url(ModelVersion, "change", chat_v1.pk))
    body = page.content.decode()
    assert set(page.context["adminform"].form.fields) == set()
    assert 'name="weights_hash"' not in body
    assert chat_v1.weights_hash in body

    response = console.post(
        url(ModelVersion, "change", chat_v1.pk),
        {
            "status": "ready",
            "eval_report_uri": "s3://models/chat-7b/evals/v1.json",
            "load_test_tokens_per_s": "2500",
            "load_test_tokens_in_flight": "110000",
            "weights_hash": digest("swapped weights"),
            "chat_template": "{{ something else }}",
            "precision": "4bit",
        },
    )

    assert response.status_code == 302
    chat_v1.refresh_from_db()
    assert chat_v1.weights_hash == digest("chat-7b weights")
    assert chat_v1.precision == "fp16"
    assert chat_v1.chat_template == version_body()["chat_template"]


def test_console_version_page_does_not_edit_what_the_gates_write(
    console: Client, chat_v1: ModelVersion
) -> None:
    response = console.post(
        url(ModelVersion, "change", chat_v1.pk),
        {
            "status": "live",
            "eval_report_uri": "https://evil.example/report",
            "load_test_tokens_per_s": "99999",
        },
    )

    assert response.status_code == 302
    chat_v1.refresh_from_db()
    assert chat_v1.status == "ready"
    assert chat_v1.eval_report_uri == ""
    assert chat_v1.load_test_tokens_per_s is None


def test_console_action_runs_the_gates_again(
    console: Client, chat_v1: ModelVersion
) -> None:
    response = console.post(
        url(ModelVersion, "changelist"),
        {"action": "run_gates_again", "_selected_action": [chat_v1.pk]},
        follow=True,
    )

    assert "gates queued (attempt 2)" in response.content.decode()
    runs = GateRun.objects.filter(version=chat_v1, attempt=2)
    assert sorted(runs.values_list("kind", flat=True)) == [
        "eval",
        "load_test",
        "weights",
    ]
    assert {run.requested_by for run in runs} == {"console user operator"}
    chat_v1.refresh_from_db()
    assert chat_v1.status == "registered"


def test_console_alias_offers_only_versions_whose_gates_passed(
    console: Client, chat_v1: ModelVersion
) -> None:
    pending = registry_services.register_version(
        model_id="chat-7b", **version_body(weights_hash=digest("v2"))
    )

    form = console.get(url(Model, "change", "chat-7b")).context["adminform"].form

    assert list(form.fields["live_version"].queryset) == [chat_v1]
    assert pending.status == "registered"


def test_console_version_list_links_eval_reports(
    console: Client, chat_v1: ModelVersion
) -> None:
    ModelVersion.objects.filter(pk=chat_v1.pk).update(
        eval_report_uri="s3://models/chat-7b/evals/v1.json"
    )

    body = console.get(url(ModelVersion, "changelist")).content.decode()

    assert '<a href="s3://models/chat-7b/evals/v1.json"' in body


def test_console_model_aliases_offer_only_its_own_versions(
    console: Client, chat_v1: ModelVersion
) -> None:
    registry_services.create_model(model_id="code-13b")
    other = registry_services.register_version(
        model_id="code-13b", **version_body(weights_uri="s3://models/code-13b/")
    )

    response = console.get(url(Model, "change", "chat-7b"))

    form = response.context["adminform"].form
    assert list(form.fields["live_version"].queryset) == [chat_v1]
    # The canary moves only through rollouts, so it is not a form field.
    assert "canary_version" not in form.fields
    assert other.ref not in response.content.decode()


def test_console_alias_change_goes_through_set_alias(
    console: Client, chat_v1: ModelVersion
) -> None:
    rollout_services.set_alias(model_id="chat-7b", version="v1")
    v2 = accept(
        registry_services.register_version(
            model_id="chat-7b", **version_body(weights_hash=digest("v2"))
        )
    )
    rollout_services.set_rollout(
        model_id="chat-7b",
        version="v2",
        stage="canary",
        percent=10,
        now=timezone.now(),
    )

    v1 = ModelVersion.objects.get(model_id="chat-7b", version="v1")
    form = {
        "description": "chat",
        "live_version": v2.pk,
        # Where the alias pointed when the page was loaded.
        "loaded_live_version": str(v1.pk),
        "versions-TOTAL_FORMS": "0",
        "versions-INITIAL_FORMS": "0",
    }
    # A page loaded before the alias moved (here: one that saw no alias) may
    # not move it: a promotion would be undone by a stale save.
    stale = console.post(
        url(Model, "change", "chat-7b"), {**form, "loaded_live_version": ""}
    )
    assert stale.status_code == 200
    assert "The alias moved since this page was loaded" in stale.content.decode()
    assert Model.objects.get(pk="chat-7b").live_version_id == v1.pk

    response = console.post(url(Model, "change", "chat-7b"), form)

    assert response.status_code == 302, response.content.decode()[:2000]
    model = Model.objects.get(pk="chat-7b")
    assert model.live_version_id == v2.pk
    assert model.canary_version_id is None
    assert dict(ModelVersion.objects.values_list("version", "status")) == {
        "v1": "ready",
        "v2": "live",
    }
    assert Rollout.objects.get().decision == "promoted"


# --- limits, usage and rollouts -------------------------------------------------


def test_console_team_limit_refuses_oversold_guarantees(
    console: Client, team: Team, chat_model: Model
) -> None:
    other = TeamFactory.create()
    accounts_services.set_team_limit(
        team_id=other.team,
        model_id="chat-7b",
        tokens_per_minute=1_000,
        max_concurrency=1,
        guaranteed_share=0.6,
    )

    response = console.post(
        url(TeamLimit, "add"),
        {
            "team": team.team,
            "model": "chat-7b",
            "tokens_per_minute": "1000",
            "max_concurrency": "1",
            "guaranteed_share": "0.5",
        },
    )

    assert response.status_code == 200
    assert "guaranteed_share" in form_errors(response)
    assert TeamLimit.objects.count() == 1


def test_console_usage_is_read_only(
    console: Client, rows: dict[type[DjangoModel], DjangoModel]
) -> None:
    usage = rows[Usage]
    assert isinstance(usage, Usage)

    change = console.post(url(Usage, "change", usage.pk), {"requests": "999"})
    delete = console.post(url(Usage, "delete", usage.pk), {"post": "yes"})

    assert change.status_code == 403
    assert delete.status_code == 403
    usage.refresh_from_db()
    assert usage.requests == 1


def test_console_usage_drills_down_by_minute(
    console: Client, rows: dict[type[DjangoModel], DjangoModel]
) -> None:
    usage = rows[Usage]
    assert isinstance(usage, Usage)
    minute = usage.minute
    response = console.get(
        url(Usage, "changelist"),
        {"minute__year": minute.year, "minute__month": minute.month},
    )
    assert response.status_code == 200
    assert response.context["cl"].result_count == 1


def test_console_starts_a_rollout_through_the_service(
    console: Client, chat_v1: ModelVersion
) -> None:
    response = console.post(
        url(Rollout, "add"),
        {"model": "chat-7b", "version": chat_v1.pk, "stage": "canary", "percent": "10"},
    )

    assert response.status_code == 302, form_errors(response)
    rollout = Rollout.objects.get()
    assert (rollout.stage, rollout.percent, rollout.decision) == (
        "canary",
        10.0,
        "pending",
    )
    model = Model.objects.get(pk="chat-7b")
    assert model.canary_version_id == chat_v1.pk
    assert model.canary_percent == 10.0


def test_console_rollout_refuses_another_models_version(
    console: Client, chat_v1: ModelVersion
) -> None:
    registry_services.create_model(model_id="code-13b")

    response = console.post(
        url(Rollout, "add"),
        {
            "model": "code-13b",
            "version": chat_v1.pk,
            "stage": "canary",
            "percent": "10",
        },
    )

    assert response.status_code == 200
    assert "version" in form_errors(response)
    assert not Rollout.objects.exists()


# --- query counts -----------------------------------------------------------------


def add_rows(
    model: type[DjangoModel], chat_v1: ModelVersion, n: int, start: int
) -> None:
    """Add ``n`` rows of ``model`` whose list columns follow foreign keys."""
    for i in range(start, start + n):
        team = TeamFactory.create()
        if model is Replica:
            ReplicaFactory(version=chat_v1)
        elif model is ApiKey:
            accounts_services.issue_key(team_id=team.team)
        elif model is TeamLimit:
            accounts_services.set_team_limit(
                team_id=team.team,
                model_id="chat-7b",
                tokens_per_minute=1_000,
                max_concurrency=1,
                guaranteed_share=0.0,
            )
        elif model is Usage:
            Usage.objects.create(
                team=team, model=chat_v1.model, version=chat_v1, minute=minute_ago(i)
            )
        elif model is ModelVersion:
            registry_services.register_version(
                model_id="chat-7b", **version_body(weights_hash=digest(f"w{i}"))
            )
        elif model is Pool:
            version = registry_services.register_version(
                model_id="chat-7b", **version_body(weights_hash=digest(f"p{i}"))
            )
            Pool.objects.create(model=chat_v1.model, version=version, region=f"r{i}")
        elif model in (PoolSchedule, ScalingDecision):
            version = registry_services.register_version(
                model_id="chat-7b", **version_body(weights_hash=digest(f"s{i}"))
            )
            pool = Pool.objects.create(
                model=chat_v1.model, version=version, region=f"r{i}"
            )
            PoolSchedule.objects.create(
                pool=pool,
                weekdays=[i % 7],
                start_minute=0,
                end_minute=60,
                min_replicas=1,
            )
            ScalingDecision.objects.create(
                pool=pool,
                region=f"r{i}",
                decided_at=timezone.now(),
                from_replicas=1,
                to_replicas=2,
                reason="utilisation",
            )


@pytest.mark.parametrize(
    "model",
    [
        Replica,
        ApiKey,
        TeamLimit,
        Usage,
        ModelVersion,
        Pool,
        PoolSchedule,
        ScalingDecision,
    ],
    ids=lambda m: m.__name__,
)
def test_console_changelist_queries_do_not_grow_with_rows(
    console: Client, chat_v1: ModelVersion, model: type[DjangoModel]
) -> None:
    def count_queries() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert console.get(url(model, "changelist")).status_code == 200
        return len(queries)

    add_rows(model, chat_v1, 2, start=0)
    few = count_queries()
    add_rows(model, chat_v1, 5, start=2)

    assert count_queries() == few


def inline_management(prefix: str, total: int, initial: int) -> dict[str, Any]:
    """Return an inline formset's management form fields."""
    return {
        f"{prefix}-TOTAL_FORMS": str(total),
        f"{prefix}-INITIAL_FORMS": str(initial),
        f"{prefix}-MIN_NUM_FORMS": "0",
        f"{prefix}-MAX_NUM_FORMS": "1000",
    }


def test_console_team_page_sets_limits_inline(
    console: Client, team: Team, chat_model: Model
) -> None:
    key, _ = accounts_services.issue_key(team_id=team.team, name="ci")
    form = {
        "name": "Search and ranking",
        **inline_management("limits", total=1, initial=0),
        "limits-0-model": "chat-7b",
        "limits-0-tokens_per_minute": "60000",
        "limits-0-max_concurrency": "8",
        "limits-0-guaranteed_share": "0.25",
        **inline_management("api_keys", total=1, initial=1),
        "api_keys-0-id": str(key.pk),
        "api_keys-0-team": team.team,
    }

    response = console.post(url(Team, "change", team.pk), form)

    assert response.status_code == 302, response.context["errors"]
    limit = TeamLimit.objects.get()
    assert (limit.team_id, limit.model_id, limit.guaranteed_share) == (
        "search",
        "chat-7b",
        0.25,
    )
    team.refresh_from_db()
    assert team.name == "Search and ranking"
    key.refresh_from_db()
    assert key.revoked_at is None


def test_console_version_page_shows_the_precisions_side_by_side(
    console: Client, chat_v1: ModelVersion
) -> None:
    table = {
        "eval_set": "file:///evals/team.jsonl",
        "reason": "precision int8 against live fp16: maths drops 0.450 (margin 0.050)",
        "statistic": "paired bootstrap (BCa)",
        "columns": [
            {"precision": "fp16", "role": "live", "version": "chat-7b@v0"},
            {"precision": "int8", "role": "candidate", "version": "chat-7b@v1"},
            {"precision": "4bit", "role": "other", "version": None, "note": "none"},
        ],
        "categories": [
            {
                "category": "maths",
                "scores": {"fp16": 0.9, "int8": 0.45, "4bit": None},
                "drops": {"fp16": 0.0, "int8": 0.45, "4bit": None},
                "interval": [-0.6, -0.3],
                "margin": 0.05,
                "passed": False,
            }
        ],
    }
    GateRun.objects.filter(version=chat_v1, kind="eval").update(
        result={"passed": False, "precision": [table]}
    )

    page = console.get(url(ModelVersion, "change", chat_v1.pk)).content.decode()

    assert "precisions side by side" in page.lower()
    assert "maths drops 0.450" in page
    assert "<th>int8 (candidate)<br><small>chat-7b@v1</small></th>" in page
    assert "<td>0.450 (drop +0.450)</td>" in page and "FAIL" in page
