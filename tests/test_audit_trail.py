"""The audit trail: every control-plane change made through the REST API or the
console appears once, with its actor, address and the fields before and after,
and never a secret."""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.test import Client, RequestFactory
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from accounts.domain.keys import hash_secret
from accounts.models import AdminToken, ApiKey, Team, TeamLimit
from audit.admin import AuditedAdmin
from audit.api.base import AuditedMixin, AuditedView
from audit.models import AuditEntry
from audit.services import Actor, Capture
from models_registry.models import GateRun, JudgeItem, ModelVersion, Pool
from rollouts.models import Rollout, VersionOverride
from tests.factories import accept, digest, version_body

if TYPE_CHECKING:
    from pytest_django import Settings
    from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db

ADDRESS = "203.0.113.7"
WRITE_METHODS = ("post", "put", "patch", "delete")


@pytest.fixture
def client_from(admin_client: APIClient) -> APIClient:
    """The admin client, sending from ``ADDRESS``."""
    admin_client.defaults["REMOTE_ADDR"] = ADDRESS
    return admin_client


@pytest.fixture
def chat_v2(chat_v1: ModelVersion) -> ModelVersion:
    """chat-7b with v1 live and v2 ready for a rollout."""
    from models_registry import services
    from rollouts.services import set_alias

    set_alias(model_id="chat-7b", version="v1")
    return accept(
        services.register_version(
            model_id="chat-7b", **version_body(weights_hash=digest("v2 weights"))
        )
    )


def only(object_type: str, object_id: object, action: str) -> AuditEntry:
    """Return the one entry of this object and action; fail on none or several."""
    found = list(
        AuditEntry.objects.filter(
            object_type=object_type, object_id=str(object_id), action=action
        )
    )
    assert len(found) == 1, [str(e) for e in AuditEntry.objects.all()]
    return found[0]


def test_rest_changes_each_appear_once_with_their_actor(
    client_from: APIClient, chat_v2: ModelVersion, team: Team
) -> None:
    """GIVEN an admin token named 'tests' calling from 203.0.113.7
    WHEN it creates a team, a model and a version, sets a limit, issues and
    revokes a key, starts a rollout, moves the alias, and changes a pool and the
    gate settings
    THEN each change is one entry naming the token and the address, with the
    fields before and after; and none holds the key or a hash."""
    token = AdminToken.objects.get(name="tests")
    pool = Pool.objects.create(
        model_id="chat-7b", version=chat_v2, region="eu", min_replicas=1
    )
    assert not AuditEntry.objects.exists()

    def call(method: str, path: str, body: Any = None, status: int = 200) -> Any:
        response = getattr(client_from, method)(path, body, format="json")
        assert response.status_code == status, response.content
        return response.json() if response.content else None

    call("post", "/admin/teams", {"team": "ads", "name": "Ads"}, 201)
    call("post", "/admin/models", {"model": "chat-9b"}, 201)
    call("post", "/admin/models/chat-9b/versions", version_body(), 201)
    limit = {
        "model": "chat-7b",
        "tokens_per_minute": 1000,
        "max_concurrency": 2,
        "guaranteed_share": 0.1,
    }
    call("put", "/admin/teams/ads/limits", limit, 201)
    issued = call("post", "/admin/teams/ads/keys", {"name": "ci"}, 201)
    call("delete", f"/admin/teams/ads/keys/{issued['id']}", None, 204)
    rollout = call(
        "put",
        "/admin/models/chat-7b/rollout",
        {"version": "v2", "stage": "canary", "percent": 10},
    )
    call("put", "/admin/models/chat-7b/alias", {"version": "v2"})
    call("put", "/admin/pools/chat-7b/v2/eu/autoscaling", {"max_replicas": 5})
    call("put", "/admin/models/chat-7b/gate_config", {"min_kappa": 0.7})

    team_entry = only("accounts.team", "ads", "create")
    assert team_entry.before is None
    assert team_entry.after is not None
    assert team_entry.after["name"] == "Ads"
    assert only("models_registry.model", "chat-9b", "create").after is not None
    version = ModelVersion.objects.get(model_id="chat-9b", version="v1")
    version_entry = only("models_registry.modelversion", version.pk, "create")
    assert version_entry.after is not None
    assert version_entry.after["version"] == "v1"
    assert version_entry.after["model_id"] == "chat-9b"
    limit_row = TeamLimit.objects.get(team_id="ads")
    limit_entry = only("accounts.teamlimit", limit_row.pk, "create")
    assert limit_entry.after is not None
    assert limit_entry.after["tokens_per_minute"] == 1000
    key_entry = only("accounts.apikey", issued["id"], "create")
    assert key_entry.after is not None
    assert key_entry.after["prefix"] == issued["prefix"]
    assert "key_hash" not in key_entry.after
    revoked = only("accounts.apikey", issued["id"], "update")
    assert revoked.changed_fields == ["revoked_at"]
    assert revoked.before is not None
    assert revoked.after is not None
    assert revoked.before["revoked_at"] is None
    assert revoked.after["revoked_at"] is not None
    started = only("rollouts.rollout", rollout["id"], "create")
    assert started.after is not None
    assert started.after["percent"] == 10
    promoted = only("rollouts.rollout", rollout["id"], "update")
    assert promoted.after is not None
    assert promoted.after["decision"] == "promoted"
    model_changes = AuditEntry.objects.filter(
        object_type="models_registry.model", object_id="chat-7b", action="update"
    ).order_by("id")
    # The canary, the alias, the gate settings: three requests, three entries.
    assert [sorted(set(e.changed_fields) - {"updated_at"}) for e in model_changes] == [
        ["canary_percent", "canary_version_id"],
        ["canary_percent", "canary_version_id", "live_version_id"],
        ["gate_config"],
    ]
    assert model_changes[1].before is not None
    assert model_changes[1].after is not None
    assert model_changes[1].before["live_version_id"] != chat_v2.pk
    assert model_changes[1].after["live_version_id"] == chat_v2.pk
    pool_entry = only("models_registry.pool", pool.pk, "update")
    assert "max_replicas" in pool_entry.changed_fields
    assert pool_entry.after is not None
    assert pool_entry.after["max_replicas"] == 5

    entries = list(AuditEntry.objects.all())
    for entry in entries:
        assert entry.actor_kind == "admin_token"
        assert entry.actor_id == str(token.pk)
        assert entry.actor_name == f"admin token {token.prefix}… (tests)"
        assert entry.remote_addr == ADDRESS
        assert entry.source == "rest"
    # One entry per object and request, never two.
    per_request = Counter((e.request_id, e.object_type, e.object_id) for e in entries)
    assert max(per_request.values()) == 1
    # No secret anywhere: the key shown once, its hash, the admin token's hash.
    trail = json.dumps([e.before for e in entries] + [e.after for e in entries])
    for secret in (issued["key"], hash_secret(issued["key"]), token.key_hash):
        assert secret not in trail
    assert "key_hash" not in trail


def test_rest_override_is_audited_with_the_traffic_change(
    client_from: APIClient, chat_v2: ModelVersion
) -> None:
    """An alias sent past the gates by an override: the override, the model and
    the version's status are three entries of one request."""
    from models_registry import services

    v3 = services.register_version(
        model_id="chat-7b", **version_body(weights_hash=digest("v3 weights"))
    )
    GateRun.objects.filter(version=v3).update(state="failed")
    ModelVersion.objects.filter(pk=v3.pk).update(
        status="rejected", status_reason="eval gate: maths drops 0.31"
    )
    response = client_from.put(
        "/admin/models/chat-7b/alias",
        {"version": "v3", "override": {"reason": "incident 42"}},
        format="json",
    )
    assert response.status_code == 200, response.content

    override = VersionOverride.objects.get()
    recorded = only("rollouts.versionoverride", override.pk, "create")
    assert recorded.after is not None
    assert recorded.after["reason"] == "incident 42"
    assert recorded.after["by"] == recorded.actor_name
    status = only("models_registry.modelversion", v3.pk, "update")
    assert status.before is not None
    assert status.after is not None
    assert (status.before["status"], status.after["status"]) == ("rejected", "live")
    alias = only("models_registry.model", "chat-7b", "update")
    assert alias.after is not None
    assert alias.after["live_version_id"] == v3.pk
    assert recorded.request_id == status.request_id == alias.request_id


def test_rest_requests_that_change_nothing_write_nothing(
    client_from: APIClient, chat_v2: ModelVersion
) -> None:
    body = {"version": "v2", "stage": "canary", "percent": 10}
    first = client_from.put("/admin/models/chat-7b/rollout", body, format="json")
    assert first.status_code == 200
    written = AuditEntry.objects.count()
    # The same rollout again (idempotent), a refused one and a read.
    again = client_from.put("/admin/models/chat-7b/rollout", body, format="json")
    assert again.status_code == 200
    refused = client_from.put(
        "/admin/models/chat-7b/alias", {"version": "v9"}, format="json"
    )
    assert refused.status_code == 404
    client_from.get("/admin/models/chat-7b")
    assert AuditEntry.objects.count() == written
    assert Rollout.objects.count() == 1


def test_rest_address_behind_a_trusted_proxy_is_the_forwarded_client(
    admin_client: APIClient, settings: Settings
) -> None:
    """Behind our proxy (10.0.0.0/8) the entry names the client it forwarded,
    not the proxy, nor what the client wrote into the header itself."""
    settings.PLATFORM_TRUSTED_PROXIES = ["10.0.0.0/8"]
    response = admin_client.post(
        "/admin/teams",
        {"team": "ads", "name": "Ads"},
        format="json",
        REMOTE_ADDR="10.0.0.5",
        HTTP_X_FORWARDED_FOR=f"192.0.2.66, {ADDRESS}, 10.0.0.9",
    )
    assert response.status_code == 201, response.content
    assert only("accounts.team", "ads", "create").remote_addr == ADDRESS


def test_rest_address_ignores_a_forwarded_header_from_an_untrusted_peer(
    client_from: APIClient, settings: Settings
) -> None:
    settings.PLATFORM_TRUSTED_PROXIES = ["10.0.0.0/8"]
    response = client_from.post(
        "/admin/teams",
        {"team": "ads", "name": "Ads"},
        format="json",
        HTTP_X_FORWARDED_FOR="10.0.0.9, 192.0.2.66",
    )
    assert response.status_code == 201, response.content
    assert only("accounts.team", "ads", "create").remote_addr == ADDRESS


def test_rest_entries_carry_the_request_id_the_caller_sent(
    client_from: APIClient,
) -> None:
    """A caller's X-Request-Id is answered back and written on the entries its
    request made; one that is no short token is replaced by a fresh id."""
    sent = client_from.post(
        "/admin/teams",
        {"team": "ads", "name": "Ads"},
        format="json",
        HTTP_X_REQUEST_ID="e2e-4f1c",
    )
    assert sent.status_code == 201, sent.content
    assert sent["X-Request-Id"] == "e2e-4f1c"
    assert only("accounts.team", "ads", "create").x_request_id == "e2e-4f1c"
    forged = client_from.post(
        "/admin/teams",
        {"team": "web", "name": "Web"},
        format="json",
        HTTP_X_REQUEST_ID="two words\r\nSet-Cookie: x=1",
    )
    assert forged.status_code == 201, forged.content
    answered = forged["X-Request-Id"]
    assert len(answered) == 32
    assert only("accounts.team", "web", "create").x_request_id == answered
    found = client_from.get("/admin/audit", {"x_request_id": "e2e-4f1c"}).json()
    assert [e["object_id"] for e in found["data"]] == ["ads"]
    assert found["data"][0]["x_request_id"] == "e2e-4f1c"


def test_every_control_plane_write_is_audited() -> None:
    """Every /admin view with a write method records its changes: a new one
    that does not derive from AuditedView fails here."""
    unaudited = []
    for view in _admin_views():
        writes = [m for m in WRITE_METHODS if hasattr(view, m)]
        if writes and not issubclass(view, AuditedView):
            unaudited.append(f"{view.__module__}.{view.__qualname__} {writes}")
    assert unaudited == []


# The team API's writes (a team's key, under /v1) that are not audited, and why.
TEAM_API_UNAUDITED = {
    # A team's own data, made with its own key: the rows name their team and
    # when. A cancel stops work already under way, so it is audited.
    "batches.api.views.FileListView",
    "batches.api.views.BatchListView",
}


def test_every_team_api_write_is_audited_or_listed_with_why() -> None:
    """Every /v1 view Django serves with a write method records its changes with
    the team's key (AuditedMixin), or is listed above."""
    unaudited = set()
    for view in _views_under("v1/"):
        writes = [m for m in WRITE_METHODS if hasattr(view, m)]
        if writes and not issubclass(view, AuditedMixin):
            unaudited.add(f"{view.__module__}.{view.__qualname__}")
    assert unaudited == TEAM_API_UNAUDITED


def _admin_views() -> list[type]:
    views = _views_under("admin/")
    assert len(views) > 10
    return views


def _views_under(prefix: str) -> list[type]:
    """Return the class-based views of the URL includes mounted at ``prefix``."""
    views = []
    for include in get_resolver().url_patterns:
        if not (isinstance(include, URLResolver) and str(include.pattern) == prefix):
            continue
        for pattern in include.url_patterns:
            assert isinstance(pattern, URLPattern)
            view_class = getattr(pattern.callback, "view_class", None)
            if view_class is not None:
                views.append(view_class)
    assert views, prefix
    return views


# The console's tables an admin may change that are not audited, and why (none:
# users and groups, batch cancels and judge labels are audited too).
CONSOLE_UNAUDITED: set[str] = set()


def test_console_tables_that_an_admin_may_change_are_audited(
    rf: RequestFactory,
) -> None:
    """Every console table with an add, change or delete permission or a list
    action for a superuser records its changes, or is listed above with why."""
    request = rf.post("/console/")
    request.user = get_user_model()(is_superuser=True, is_staff=True, is_active=True)
    unaudited = set()
    for model, model_admin in admin.site._registry.items():
        writes = any(
            getattr(model_admin, f"has_{p}_permission")(request)
            for p in ("add", "change", "delete")
        )
        if (writes or model_admin.get_actions(request)) and not isinstance(
            model_admin, AuditedAdmin
        ):
            unaudited.add(model._meta.label_lower)
    assert unaudited == CONSOLE_UNAUDITED


@pytest.fixture
def console(db: None) -> Client:
    """A console user 'operator' logged in from ``ADDRESS``."""
    user = get_user_model().objects.create_superuser(
        username="operator", email="operator@example.com", password=None
    )
    client = Client(REMOTE_ADDR=ADDRESS)
    client.force_login(user)
    return client


def test_console_changes_appear_once_with_the_user(
    console: Client, team: Team, chat_v2: ModelVersion
) -> None:
    """GIVEN the console user 'operator'
    WHEN they issue a key (shown once), revoke it with the list's action, and
    start a rollout from the rollout page
    THEN each is one entry naming 'operator' and the address; the key is not in it."""
    added = console.post(
        "/console/accounts/apikey/add/", {"team": "search", "name": "ops"}
    )
    assert added.status_code == 200
    key = ApiKey.objects.get(name="ops")
    secret = added.context["secret"]
    assert hash_secret(secret) == key.key_hash
    revoked = console.post(
        "/console/accounts/apikey/",
        {"action": "revoke_selected", "_selected_action": [key.pk]},
    )
    assert revoked.status_code == 302
    started = console.post(
        "/console/rollouts/chat-7b/", {"action": "start", "version": "v2"}
    )
    assert started.status_code == 302
    rollout = Rollout.objects.get()

    created = only("accounts.apikey", key.pk, "create")
    update = only("accounts.apikey", key.pk, "update")
    assert update.changed_fields == ["revoked_at"]
    begun = only("rollouts.rollout", rollout.pk, "create")
    user = get_user_model().objects.get(username="operator")
    for entry in (created, update, begun):
        assert entry.actor_kind == "user"
        assert entry.actor_id == str(user.pk)
        assert entry.actor_name == "operator"
        assert entry.remote_addr == ADDRESS
        assert entry.source == "console"
    trail = json.dumps([[e.before, e.after] for e in AuditEntry.objects.all()])
    assert secret not in trail
    assert key.key_hash not in trail
    assert rollout.version_id == chat_v2.pk


def test_console_lists_the_trail_read_only_and_filtered(
    console: Client, team: Team
) -> None:
    console.post("/console/accounts/apikey/add/", {"team": "search", "name": "ops"})
    console.post("/console/accounts/apikey/add/", {"team": "search", "name": "ci"})
    entries = list(AuditEntry.objects.order_by("id"))
    assert len(entries) == 2
    page = console.get(
        "/console/audit/auditentry/",
        {"actor_name": "operator", "object_type": "accounts.apikey"},
    )
    assert page.status_code == 200
    assert page.context["cl"].result_count == 2
    assert (
        console.get("/console/audit/auditentry/", {"actor_name": "somebody else"})
        .context["cl"]
        .result_count
        == 0
    )
    detail = console.get(f"/console/audit/auditentry/{entries[0].pk}/change/")
    assert detail.status_code == 200
    assert b"&quot;name&quot;: &quot;ops&quot;" in detail.content
    # No add, change, delete or action, even for a superuser.
    assert console.get("/console/audit/auditentry/add/").status_code == 403
    deleted = console.post(
        f"/console/audit/auditentry/{entries[0].pk}/delete/", {"post": "yes"}
    )
    assert deleted.status_code == 403
    changed = console.post(
        f"/console/audit/auditentry/{entries[0].pk}/change/", {"actor_name": "x"}
    )
    assert changed.status_code == 403
    assert list(AuditEntry.objects.order_by("id")) == entries
    assert AuditEntry.objects.get(pk=entries[0].pk).actor_name == "operator"


def test_console_users_and_groups_are_audited_without_passwords(
    console: Client,
) -> None:
    """GIVEN the console user 'operator'
    WHEN they make a group with a permission, add a user 'ana' with a password,
    put her in the group, and set her a new password
    THEN each change is an entry naming 'operator': the group, its permission,
    the user, her membership; the new password is named as changed, and no
    password hash is anywhere in the trail."""
    permission = Permission.objects.get(codename="view_team")
    made = console.post(
        "/console/auth/group/add/", {"name": "viewers", "permissions": [permission.pk]}
    )
    assert made.status_code == 302, made.content
    group = Group.objects.get(name="viewers")
    added = console.post(
        "/console/auth/user/add/",
        {
            "username": "ana",
            "usable_password": "true",
            "password1": "first-pass-7f2c",
            "password2": "first-pass-7f2c",
        },
    )
    assert added.status_code == 302, added.content
    ana = get_user_model().objects.get(username="ana")
    first_hash = ana.password
    joined = ana.date_joined
    changed = console.post(
        f"/console/auth/user/{ana.pk}/change/",
        {
            "username": "ana",
            "email": "ana@example.com",
            "is_active": "on",
            "is_staff": "on",
            "groups": [group.pk],
            "date_joined_0": joined.strftime("%Y-%m-%d"),
            "date_joined_1": joined.strftime("%H:%M:%S.%f"),
        },
    )
    assert changed.status_code == 302, changed.content
    password = console.post(
        f"/console/auth/user/{ana.pk}/password/",
        {"password1": "second-pass-9a1d", "password2": "second-pass-9a1d"},
    )
    assert password.status_code == 302, password.content
    ana.refresh_from_db()

    only("auth.group", group.pk, "create")
    granted = AuditEntry.objects.get(object_type="auth.group_permissions")
    assert granted.after is not None
    assert granted.after["permission_id"] == permission.pk
    assert only("auth.user", ana.pk, "create").after is not None
    updates = list(
        AuditEntry.objects.filter(
            object_type="auth.user", object_id=str(ana.pk), action="update"
        ).order_by("id")
    )
    assert [e.changed_fields for e in updates] == [
        ["email", "is_staff"],
        ["password"],
    ]
    membership = AuditEntry.objects.get(object_type="auth.user_groups")
    assert membership.after is not None
    assert (membership.after["user_id"], membership.after["group_id"]) == (
        ana.pk,
        group.pk,
    )
    assert membership.request_id == updates[0].request_id
    entries = list(AuditEntry.objects.all())
    assert {(e.actor_name, e.source, e.remote_addr) for e in entries} == {
        ("operator", "console", ADDRESS)
    }
    trail = json.dumps([[e.before, e.after] for e in entries])
    for secret in (first_hash, ana.password, "first-pass-7f2c", "second-pass-9a1d"):
        assert secret not in trail
    assert '"password"' not in trail


def test_console_judge_label_is_audited_with_the_reviewer(console: Client) -> None:
    item = JudgeItem.objects.create(
        judge="reason-70b@v1",
        judge_prompt="judge-v1",
        candidate="chat-7b@v2",
        live="chat-7b@v1",
        eval_set="file:///evals/default.jsonl",
        item_id="maths-1",
        question=[{"role": "user", "content": "What is 1 times 3?"}],
        answer_a="3",
        answer_b="4",
        candidate_side="a",
        judge_verdict="candidate",
    )
    assert (
        console.post(
            "/console/judge-labels/", {"item": item.pk, "label": "a"}
        ).status_code
        == 302
    )
    # Labelled already: refused, and nothing more is written.
    console.post("/console/judge-labels/", {"item": item.pk, "label": "b"})

    entry = only("models_registry.judgeitem", item.pk, "update")
    assert entry.changed_fields == ["label", "labelled_at", "labelled_by"]
    assert entry.before is not None
    assert entry.after is not None
    assert (entry.before["label"], entry.after["label"]) == ("", "a")
    assert (entry.actor_name, entry.source) == ("operator", "console")
    assert AuditEntry.objects.count() == 1


def test_capture_of_a_narrowed_scope_sees_only_its_fields(team: Team) -> None:
    """A scope narrowed with .only() records a write of its fields, never a
    write of another field that lands while the request runs."""
    actor = Actor(
        kind="user",
        actor_id="1",
        name="operator",
        remote_addr=None,
        source="console",
        method="POST",
        path="/console/",
    )
    rows = Team.objects.filter(pk=team.pk).only("name")
    capture = Capture(actor, [rows])
    Team.objects.filter(pk=team.pk).update(created_at=timezone.now())
    assert capture.finish() == []
    capture = Capture(actor, [rows])
    Team.objects.filter(pk=team.pk).update(name="Search and ads")
    (entry,) = capture.finish()
    assert entry.changed_fields == ["name"]
    assert entry.after == {"team": "search", "name": "Search and ads"}
