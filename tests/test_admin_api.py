"""The control-plane REST API at the seed's paths: success, validation, auth, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from django.utils import timezone

from accounts.domain.keys import hash_secret
from accounts.models import AdminToken, ApiKey, TeamLimit
from engine_nodes.models import Replica
from metering.models import Usage, VersionFigure
from models_registry.models import Model, ModelVersion
from rollouts.models import Rollout
from tests.factories import ReplicaFactory, accept, digest, version_body

if TYPE_CHECKING:
    from pytest_django import DjangoAssertNumQueries, Settings
    from rest_framework.response import _MonkeyPatchedResponse as ApiResponse
    from rest_framework.test import APIClient

    from accounts.models import Team

pytestmark = pytest.mark.django_db

# Every control-plane endpoint, with a method and a body that would be valid.
ENDPOINTS = [
    ("get", "/admin/schema", None),
    ("get", "/admin/models", None),
    ("post", "/admin/models", {"model": "x-1"}),
    ("get", "/admin/models/chat-7b", None),
    ("post", "/admin/models/chat-7b/versions", version_body()),
    (
        "put",
        "/admin/models/chat-7b/rollout",
        {"version": "v1", "stage": "canary", "percent": 1},
    ),
    ("put", "/admin/models/chat-7b/alias", {"version": "v1"}),
    ("get", "/admin/models/chat-7b/versions/v1/gates", None),
    ("post", "/admin/models/chat-7b/versions/v1/gates", None),
    ("get", "/admin/models/chat-7b/gate_config", None),
    ("put", "/admin/models/chat-7b/gate_config", {"min_kappa": 0.7}),
    (
        "put",
        "/admin/teams/search/limits",
        {
            "model": "chat-7b",
            "tokens_per_minute": 1000,
            "max_concurrency": 2,
            "guaranteed_share": 0.1,
        },
    ),
    ("get", "/admin/teams/search/entitlements", None),
    (
        "put",
        "/admin/teams/search/entitlements",
        {"model": "chat-7b", "tiers": ["standard"]},
    ),
    ("get", "/admin/teams/search/budgets", None),
    ("put", "/admin/teams/search/budgets", {"monthly_usd": 100.0}),
    ("get", "/admin/pools/chat-7b/state", None),
    ("get", "/admin/teams", None),
    ("post", "/admin/teams", {"team": "ads"}),
    ("post", "/admin/teams/search/keys", {}),
    ("delete", "/admin/teams/search/keys/1", None),
]


def assert_error(
    response: ApiResponse, status: int, error_type: str, param: str | None = None
) -> None:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"}
    assert {"type", "message", "param", "code"} <= set(body["error"])
    assert body["error"]["type"] == error_type
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


# --- auth -----------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_admin_endpoint_without_token_is_401(
    anon_client: APIClient,
    chat_v1: ModelVersion,
    team: Team,
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    response = getattr(anon_client, method)(path, body, format="json")
    assert_error(response, 401, "authentication_error")
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_admin_endpoint_with_team_key_is_403(
    anon_client: APIClient,
    chat_v1: ModelVersion,
    team_secret: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    anon_client.credentials(HTTP_AUTHORIZATION=f"Bearer {team_secret}")
    response = getattr(anon_client, method)(path, body, format="json")
    assert_error(response, 403, "permission_error")
    # Nothing was written by the refused call.
    assert not Model.objects.filter(pk="x-1").exists()
    assert ModelVersion.objects.count() == 1
    assert not TeamLimit.objects.exists()


def test_admin_endpoint_with_unknown_token_is_401(anon_client: APIClient) -> None:
    anon_client.credentials(HTTP_AUTHORIZATION="Bearer sk-admin-not-a-real-token")
    assert_error(anon_client.get("/admin/teams"), 401, "authentication_error")


def test_admin_endpoint_with_malformed_header_is_401(anon_client: APIClient) -> None:
    anon_client.credentials(HTTP_AUTHORIZATION="Basic dXNlcjpwYXNz")
    assert_error(anon_client.get("/admin/teams"), 401, "authentication_error")


def test_admin_endpoint_with_revoked_token_is_401(
    anon_client: APIClient, admin_secret: str
) -> None:
    AdminToken.objects.update(revoked_at=timezone.now())
    anon_client.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_secret}")
    assert_error(anon_client.get("/admin/teams"), 401, "authentication_error")


def test_admin_token_use_is_recorded(admin_client: APIClient) -> None:
    assert admin_client.get("/admin/teams").status_code == 200
    assert AdminToken.objects.get().last_used_at is not None


def test_unknown_admin_path_is_json_404(admin_client: APIClient) -> None:
    assert_error(admin_client.get("/admin/nothing/here"), 404, "not_found_error")


def test_wrong_method_is_405_in_error_shape(
    admin_client: APIClient, chat_model: Model
) -> None:
    assert_error(
        admin_client.delete("/admin/models/chat-7b"), 405, "invalid_request_error"
    )


def test_invalid_json_body_is_400(admin_client: APIClient, chat_model: Model) -> None:
    response = admin_client.post(
        "/admin/models/chat-7b/versions",
        data="{not json",
        content_type="application/json",
    )
    assert_error(response, 400, "invalid_request_error")


def test_body_that_is_not_an_object_is_400(
    admin_client: APIClient, chat_model: Model
) -> None:
    response = admin_client.post(
        "/admin/models/chat-7b/versions", [1, 2], format="json"
    )
    assert_error(response, 400, "invalid_request_error")


def test_schema_lists_the_seed_paths(admin_client: APIClient) -> None:
    response = admin_client.get("/admin/schema")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/vnd.oai.openapi+json")
    paths = json.loads(response.content)["paths"]
    for path in [
        "/admin/models/{model}/versions",
        "/admin/models/{model}/rollout",
        "/admin/models/{model}/alias",
        "/admin/teams/{team}/limits",
        "/admin/pools/{model}/state",
    ]:
        assert path in paths


def test_schema_says_what_the_api_answers(admin_client: APIClient) -> None:
    """The versions list is an envelope, names carry the slug rule, and every
    operation documents its errors in the one error shape."""
    schema = json.loads(admin_client.get("/admin/schema").content)
    components = schema["components"]["schemas"]
    versions = schema["paths"]["/admin/models/{model}/versions"]["get"]
    listed = versions["responses"]["200"]["content"]["application/json"]["schema"]
    envelope = components[listed["$ref"].rsplit("/", 1)[1]]
    assert envelope["properties"]["data"]["type"] == "array"
    assert envelope["required"] == ["data"]
    (model,) = (p for p in versions["parameters"] if p["name"] == "model")
    assert model["schema"]["pattern"] == "^[a-z0-9][a-z0-9._-]{0,63}$"
    assert components["TeamCreate"]["properties"]["team"]["pattern"] == (
        "^[a-z0-9][a-z0-9._-]{0,63}$"
    )
    assert components["Limit"]["properties"]["max_concurrency"]["maximum"] == (
        2**31 - 1
    )
    error = {"$ref": "#/components/schemas/Error"}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            expected = {"400", "401", "403"}
            if "{" in path:
                expected.add("404")
            if method in {"post", "put"}:
                expected |= {"413", "415"}
            responses = operation["responses"]
            assert expected <= set(responses), (method, path)
            for code in expected:
                body = responses[code]["content"]["application/json"]["schema"]
                assert body == error, (method, path, code)


# --- models and versions -----------------------------------------------------------------


def test_create_model(admin_client: APIClient) -> None:
    response = admin_client.post(
        "/admin/models", {"model": "reason-70b"}, format="json"
    )
    assert response.status_code == 201
    assert response.json()["model"] == "reason-70b"
    assert Model.objects.filter(pk="reason-70b").exists()


def test_create_an_embedding_model(admin_client: APIClient) -> None:
    body = {
        "model": "embed-1",
        "kind": "embedding",
        "dimensions": 384,
        "max_input_tokens": 512,
    }
    response = admin_client.post("/admin/models", body, format="json")
    assert response.status_code == 201, response.content
    data = response.json()
    assert (data["kind"], data["dimensions"], data["max_input_tokens"]) == (
        "embedding",
        384,
        512,
    )
    chat = admin_client.post("/admin/models", {"model": "c-1"}, format="json").json()
    assert (chat["kind"], chat["dimensions"], chat["max_input_tokens"]) == (
        "chat",
        None,
        None,
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"kind": "vision"}, "kind"),
        ({"kind": "embedding", "max_input_tokens": 512}, "dimensions"),
        ({"kind": "embedding", "dimensions": 384}, "max_input_tokens"),
        ({"kind": "embedding", "dimensions": 0, "max_input_tokens": 8}, "dimensions"),
        ({"dimensions": 384}, "dimensions"),
        ({"max_input_tokens": 512}, "max_input_tokens"),
    ],
)
def test_create_model_with_bad_kind_or_sizes_is_400(
    admin_client: APIClient, extra: dict[str, object], param: str
) -> None:
    body = {"model": "embed-1", **extra}
    response = admin_client.post("/admin/models", body, format="json")
    assert_error(response, 400, "invalid_request_error", param)
    assert not Model.objects.filter(pk="embed-1").exists()


def test_create_model_twice_is_409(admin_client: APIClient, chat_model: Model) -> None:
    response = admin_client.post("/admin/models", {"model": "chat-7b"}, format="json")
    assert_error(response, 409, "conflict_error", "model")


def test_create_model_with_bad_name_is_400(admin_client: APIClient) -> None:
    response = admin_client.post("/admin/models", {"model": "Chat@7b"}, format="json")
    assert_error(response, 400, "invalid_request_error", "model")


def test_register_version_returns_v1_with_template_hash(
    admin_client: APIClient, chat_model: Model
) -> None:
    body = version_body()
    response = admin_client.post("/admin/models/chat-7b/versions", body, format="json")
    assert response.status_code == 201, response.content
    data = response.json()
    assert data["version"] == "v1"
    assert data["status"] == "registered"
    assert data["chat_template_hash"] == digest(body["chat_template"])
    assert data["weights_hash"] == body["weights_hash"]
    stored = ModelVersion.objects.get(model_id="chat-7b", version="v1")
    assert stored.engine_config == body["engine_config"]


def test_register_version_numbers_versions_in_order(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    body = version_body(weights_hash=digest("other weights"))
    response = admin_client.post("/admin/models/chat-7b/versions", body, format="json")
    assert response.json()["version"] == "v2"


def test_register_version_accepts_an_explicit_label(
    admin_client: APIClient, chat_model: Model
) -> None:
    body = version_body(version="v13")
    response = admin_client.post("/admin/models/chat-7b/versions", body, format="json")
    assert response.json()["version"] == "v13"
    body = version_body(weights_hash=digest("next"))
    response = admin_client.post("/admin/models/chat-7b/versions", body, format="json")
    assert response.json()["version"] == "v14"


def test_register_same_identity_twice_is_409(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    # Same identity with the engine config keys in another order is still a duplicate.
    config = dict(reversed(list(version_body()["engine_config"].items())))
    response = admin_client.post(
        "/admin/models/chat-7b/versions",
        version_body(engine_config=config),
        format="json",
    )
    assert_error(response, 409, "conflict_error")
    assert "chat-7b@v1" in response.json()["error"]["message"]
    assert ModelVersion.objects.count() == 1


def test_register_existing_label_is_409(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    body = version_body(version="v1", weights_hash=digest("new"))
    response = admin_client.post("/admin/models/chat-7b/versions", body, format="json")
    assert_error(response, 409, "conflict_error", "version")


def test_register_version_for_unknown_model_is_404(admin_client: APIClient) -> None:
    response = admin_client.post(
        "/admin/models/nope/versions", version_body(), format="json"
    )
    assert_error(response, 404, "not_found_error", "model")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"weights_hash": "abc"}, "weights_hash"),
        ({"weights_hash": "g" * 64}, "weights_hash"),
        ({"tokenizer_hash": "0" * 63}, "tokenizer_hash"),
        ({"precision": "fp8"}, "precision"),
        ({"gpus_per_replica": 0}, "gpus_per_replica"),
        ({"gpus_per_replica": 65}, "gpus_per_replica"),
        ({"engine_config": [1, 2]}, "engine_config"),
        ({"engine_config": {"engine": "tgi"}}, "engine_config"),
        ({"chat_template": "   "}, "chat_template"),
        ({"weights_uri": "s3://elsewhere/w/"}, "weights_uri"),
        ({"weights_uri": "s3://models/../secrets/"}, "weights_uri"),
        ({"weights_uri": "file:///etc/passwd"}, "weights_uri"),
        ({"eval_report_uri": "http://example.com/r"}, "eval_report_uri"),
        ({"version": "13"}, "version"),
    ],
)
def test_register_version_rejects_bad_fields(
    admin_client: APIClient, chat_model: Model, change: dict[str, Any], param: str
) -> None:
    response = admin_client.post(
        "/admin/models/chat-7b/versions", version_body(**change), format="json"
    )
    assert_error(response, 400, "invalid_request_error", param)
    assert not ModelVersion.objects.exists()


def _weights_with_heads(root: Path, heads: int, kv_heads: int | None) -> str:
    root.mkdir(parents=True)
    config: dict[str, Any] = {"num_attention_heads": heads}
    if kv_heads is not None:
        config["num_key_value_heads"] = kv_heads
    (root / "config.json").write_text(json.dumps(config))
    return f"file://{root}/"


@pytest.mark.parametrize(
    ("gpus", "heads", "kv_heads"), [(3, 32, 8), (16, 32, 8), (8, 28, None)]
)
def test_register_version_refuses_gpus_that_do_not_split_the_heads(
    admin_client: APIClient,
    chat_model: Model,
    tmp_path: Path,
    settings: Settings,
    gpus: int,
    heads: int,
    kv_heads: int | None,
) -> None:
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    uri = _weights_with_heads(tmp_path / "w", heads, kv_heads)
    response = admin_client.post(
        "/admin/models/chat-7b/versions",
        version_body(weights_uri=uri, gpus_per_replica=gpus),
        format="json",
    )
    assert_error(response, 400, "invalid_request_error", "gpus_per_replica")
    message = response.json()["error"]["message"]
    kv = heads if kv_heads is None else kv_heads
    assert f"gpus_per_replica {gpus}" in message
    assert f"attention heads ({heads})" in message
    assert f"KV heads ({kv})" in message
    assert not ModelVersion.objects.exists()


def test_register_version_accepts_gpus_that_split_the_heads(
    admin_client: APIClient, chat_model: Model, tmp_path: Path, settings: Settings
) -> None:
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    uri = _weights_with_heads(tmp_path / "w", 32, 8)
    response = admin_client.post(
        "/admin/models/chat-7b/versions",
        version_body(weights_uri=uri, gpus_per_replica=8),
        format="json",
    )
    assert response.status_code == 201, response.content


def test_register_version_refuses_weights_whose_config_is_no_json(
    admin_client: APIClient, chat_model: Model, tmp_path: Path, settings: Settings
) -> None:
    settings.PLATFORM_STORAGE_ROOTS = [f"file://{tmp_path}/"]
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text("{not json")
    response = admin_client.post(
        "/admin/models/chat-7b/versions",
        version_body(weights_uri=f"file://{tmp_path}/w/"),
        format="json",
    )
    assert_error(response, 400, "invalid_request_error", "weights_uri")


def test_register_version_missing_field_names_it(
    admin_client: APIClient, chat_model: Model
) -> None:
    body = version_body()
    del body["tokenizer_hash"]
    response = admin_client.post("/admin/models/chat-7b/versions", body, format="json")
    assert_error(response, 400, "invalid_request_error", "tokenizer_hash")


def test_register_version_accepts_uppercase_hash_and_stores_lowercase(
    admin_client: APIClient, chat_model: Model
) -> None:
    body = version_body(weights_hash=digest("w").upper())
    response = admin_client.post("/admin/models/chat-7b/versions", body, format="json")
    assert response.status_code == 201
    assert response.json()["weights_hash"] == digest("w")


def test_get_model_shows_versions_and_alias(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    admin_client.put("/admin/models/chat-7b/alias", {"version": "v1"}, format="json")
    data = admin_client.get("/admin/models/chat-7b").json()
    assert data["live_version"] == "v1"
    assert [v["version"] for v in data["versions"]] == ["v1"]
    assert "chat_template" not in data["versions"][0]


def test_version_schema_names_the_fields_the_api_returns(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    from models_registry.api.serializers import VersionSerializer

    data = admin_client.get("/admin/models/chat-7b/versions").json()["data"]
    assert set(VersionSerializer().fields) == set(data[0])


def test_get_unknown_model_is_404(admin_client: APIClient) -> None:
    assert_error(
        admin_client.get("/admin/models/nope"), 404, "not_found_error", "model"
    )


# --- alias and rollout ---------------------------------------------------------------


@pytest.fixture
def chat_v2(chat_v1: ModelVersion) -> ModelVersion:
    from models_registry import services
    from rollouts.services import set_alias

    set_alias(model_id="chat-7b", version="v1")
    return accept(
        services.register_version(
            model_id="chat-7b", **version_body(weights_hash=digest("v2 weights"))
        )
    )


def test_canary_rollout_sets_the_model_canary(
    admin_client: APIClient, chat_v2: ModelVersion
) -> None:
    response = admin_client.put(
        "/admin/models/chat-7b/rollout",
        {"version": "v2", "stage": "canary", "percent": 10},
        format="json",
    )
    assert response.status_code == 200, response.content
    assert response.json()["stage"] == "canary"
    model = Model.objects.get(pk="chat-7b")
    assert model.canary_version_id == chat_v2.pk
    assert model.canary_percent == 10


def test_shadow_rollout_clears_the_canary(
    admin_client: APIClient, chat_v2: ModelVersion
) -> None:
    admin_client.put(
        "/admin/models/chat-7b/rollout",
        {"version": "v2", "stage": "canary", "percent": 10},
        format="json",
    )
    response = admin_client.put(
        "/admin/models/chat-7b/rollout",
        {"version": "v2", "stage": "shadow", "percent": 1},
        format="json",
    )
    assert response.status_code == 200
    model = Model.objects.get(pk="chat-7b")
    assert model.canary_version_id is None
    assert model.canary_percent == 0
    decisions = list(Rollout.objects.order_by("id").values_list("decision", flat=True))
    assert decisions == ["superseded", "pending"]


def test_repeating_a_rollout_is_idempotent(
    admin_client: APIClient, chat_v2: ModelVersion
) -> None:
    body = {"version": "v2", "stage": "canary", "percent": 1}
    first = admin_client.put(
        "/admin/models/chat-7b/rollout", body, format="json"
    ).json()
    second = admin_client.put(
        "/admin/models/chat-7b/rollout", body, format="json"
    ).json()
    assert first["id"] == second["id"]
    assert Rollout.objects.count() == 1


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"version": "v2", "stage": "blue", "percent": 1}, 400, "stage"),
        ({"version": "v2", "stage": "canary", "percent": 0}, 400, "percent"),
        ({"version": "v2", "stage": "canary", "percent": 101}, 400, "percent"),
        ({"version": "v1", "stage": "canary", "percent": 5}, 409, "version"),
        ({"version": "v9", "stage": "canary", "percent": 5}, 404, "version"),
        ({"stage": "canary", "percent": 5}, 400, "version"),
    ],
)
def test_rollout_rejects_bad_requests(
    admin_client: APIClient,
    chat_v2: ModelVersion,
    body: dict[str, Any] | None,
    status: int,
    param: str,
) -> None:
    response = admin_client.put("/admin/models/chat-7b/rollout", body, format="json")
    error_type = {404: "not_found_error", 409: "conflict_error"}.get(
        status, "invalid_request_error"
    )
    assert_error(response, status, error_type, param)
    assert not Rollout.objects.exists()


def test_rollout_on_unknown_model_is_404(admin_client: APIClient) -> None:
    response = admin_client.put(
        "/admin/models/nope/rollout",
        {"version": "v1", "stage": "canary", "percent": 1},
        format="json",
    )
    assert_error(response, 404, "not_found_error", "model")


def test_alias_promotes_the_canary(
    admin_client: APIClient, chat_v2: ModelVersion
) -> None:
    admin_client.put(
        "/admin/models/chat-7b/rollout",
        {"version": "v2", "stage": "canary", "percent": 50},
        format="json",
    )
    response = admin_client.put(
        "/admin/models/chat-7b/alias", {"version": "v2"}, format="json"
    )
    assert response.status_code == 200
    assert response.json()["live_version"] == "v2"
    model = Model.objects.get(pk="chat-7b")
    assert model.canary_version_id is None
    assert Rollout.objects.get().decision == "promoted"
    statuses = dict(ModelVersion.objects.values_list("version", "status"))
    # The old version stays registered and ready for a one-call rollback.
    assert statuses == {"v1": "ready", "v2": "live"}


def test_alias_back_to_old_version_rolls_back(
    admin_client: APIClient, chat_v2: ModelVersion
) -> None:
    admin_client.put(
        "/admin/models/chat-7b/rollout",
        {"version": "v2", "stage": "canary", "percent": 10},
        format="json",
    )
    response = admin_client.put(
        "/admin/models/chat-7b/alias", {"version": "v1"}, format="json"
    )
    assert response.json()["live_version"] == "v1"
    assert response.json()["canary_version"] is None
    assert Rollout.objects.get().decision == "rolled_back"


def test_alias_to_rejected_version_is_409(
    admin_client: APIClient, chat_v2: ModelVersion
) -> None:
    ModelVersion.objects.filter(pk=chat_v2.pk).update(status="rejected")
    response = admin_client.put(
        "/admin/models/chat-7b/alias", {"version": "v2"}, format="json"
    )
    assert_error(response, 409, "conflict_error", "version")
    live = Model.objects.get(pk="chat-7b").live_version
    assert live is not None
    assert live.version == "v1"


def test_alias_to_unknown_version_is_404(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    response = admin_client.put(
        "/admin/models/chat-7b/alias", {"version": "v7"}, format="json"
    )
    assert_error(response, 404, "not_found_error", "version")


# --- teams, keys, limits --------------------------------------------------------------


def test_create_team(admin_client: APIClient) -> None:
    response = admin_client.post(
        "/admin/teams", {"team": "ads", "name": "Ads"}, format="json"
    )
    assert response.status_code == 201
    assert response.json() == {**response.json(), "team": "ads", "name": "Ads"}


def test_create_team_twice_is_409(admin_client: APIClient, team: Team) -> None:
    response = admin_client.post("/admin/teams", {"team": "search"}, format="json")
    assert_error(response, 409, "conflict_error", "team")


def test_create_team_with_bad_slug_is_400(admin_client: APIClient) -> None:
    response = admin_client.post("/admin/teams", {"team": "Not A Slug"}, format="json")
    assert_error(response, 400, "invalid_request_error", "team")


def test_issue_key_returns_the_secret_once_and_stores_its_hash(
    admin_client: APIClient, team: Team
) -> None:
    response = admin_client.post(
        "/admin/teams/search/keys", {"name": "ci"}, format="json"
    )
    assert response.status_code == 201
    secret = response.json()["key"]
    stored = ApiKey.objects.get(pk=response.json()["id"])
    assert stored.key_hash == hash_secret(secret)
    assert secret.startswith(stored.prefix)
    assert secret not in {stored.prefix, stored.name, stored.key_hash}
    listing = admin_client.get("/admin/teams/search/keys").content.decode()
    assert secret not in listing
    assert stored.key_hash not in listing
    assert stored.prefix in listing


def test_issue_key_for_unknown_team_is_404(admin_client: APIClient) -> None:
    response = admin_client.post("/admin/teams/nope/keys", {}, format="json")
    assert_error(response, 404, "not_found_error", "team")


def test_revoke_key(admin_client: APIClient, team: Team) -> None:
    key_id = admin_client.post("/admin/teams/search/keys", {}, format="json").json()[
        "id"
    ]
    response = admin_client.delete(f"/admin/teams/search/keys/{key_id}")
    assert response.status_code == 204
    first = ApiKey.objects.get(pk=key_id).revoked_at
    assert first is not None
    # Revoking again is harmless and keeps the first time.
    assert admin_client.delete(f"/admin/teams/search/keys/{key_id}").status_code == 204
    assert ApiKey.objects.get(pk=key_id).revoked_at == first


def test_revoked_team_key_is_401_not_403(
    admin_client: APIClient, anon_client: APIClient, team: Team
) -> None:
    created = admin_client.post("/admin/teams/search/keys", {}, format="json").json()
    admin_client.delete(f"/admin/teams/search/keys/{created['id']}")
    anon_client.credentials(HTTP_AUTHORIZATION=f"Bearer {created['key']}")
    assert_error(anon_client.get("/admin/teams"), 401, "authentication_error")


def test_revoke_other_teams_key_is_404(admin_client: APIClient, team: Team) -> None:
    from accounts import services

    services.create_team(team_id="ads")
    key, _ = services.issue_key(team_id="ads")
    response = admin_client.delete(f"/admin/teams/search/keys/{key.pk}")
    assert_error(response, 404, "not_found_error", "key_id")
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None


def test_set_limits_creates_then_replaces(
    admin_client: APIClient, team: Team, chat_model: Model
) -> None:
    body = {
        "model": "chat-7b",
        "tokens_per_minute": 60000,
        "max_concurrency": 20,
        "guaranteed_share": 0.25,
    }
    response = admin_client.put("/admin/teams/search/limits", body, format="json")
    assert response.status_code == 201
    assert response.json() == {"team": "search", **body}
    body["tokens_per_minute"] = 90000
    response = admin_client.put("/admin/teams/search/limits", body, format="json")
    assert response.status_code == 200
    assert TeamLimit.objects.get().tokens_per_minute == 90000


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tokens_per_minute": 0}, "tokens_per_minute"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"guaranteed_share": 1.5}, "guaranteed_share"),
        ({"guaranteed_share": -0.1}, "guaranteed_share"),
        ({"tokens_per_minute": "many"}, "tokens_per_minute"),
    ],
)
def test_set_limits_rejects_bad_values(
    admin_client: APIClient,
    team: Team,
    chat_model: Model,
    change: dict[str, Any],
    param: str,
) -> None:
    body = {
        "model": "chat-7b",
        "tokens_per_minute": 1000,
        "max_concurrency": 2,
        "guaranteed_share": 0.1,
        **change,
    }
    response = admin_client.put("/admin/teams/search/limits", body, format="json")
    assert_error(response, 400, "invalid_request_error", param)
    assert not TeamLimit.objects.exists()


def test_set_limits_refuses_shares_over_the_whole_pool(
    admin_client: APIClient, team: Team, chat_model: Model
) -> None:
    from accounts import services

    services.create_team(team_id="ads")
    services.set_team_limit(
        team_id="ads",
        model_id="chat-7b",
        tokens_per_minute=1000,
        max_concurrency=1,
        guaranteed_share=0.7,
    )
    body = {
        "model": "chat-7b",
        "tokens_per_minute": 1000,
        "max_concurrency": 2,
        "guaranteed_share": 0.4,
    }
    response = admin_client.put("/admin/teams/search/limits", body, format="json")
    assert_error(response, 409, "conflict_error", "guaranteed_share")
    body["guaranteed_share"] = 0.3
    assert (
        admin_client.put("/admin/teams/search/limits", body, format="json").status_code
        == 201
    )


def test_set_limits_unknown_team_or_model_is_404(
    admin_client: APIClient, team: Team, chat_model: Model
) -> None:
    body = {"model": "chat-7b", "tokens_per_minute": 1000, "max_concurrency": 2}
    response = admin_client.put("/admin/teams/nope/limits", body, format="json")
    assert_error(response, 404, "not_found_error", "team")
    response = admin_client.put(
        "/admin/teams/search/limits", {**body, "model": "nope"}, format="json"
    )
    assert_error(response, 404, "not_found_error", "model")


def test_list_teams_has_fixed_query_count(
    admin_client: APIClient,
    chat_model: Model,
    django_assert_max_num_queries: DjangoAssertNumQueries,
) -> None:
    from accounts import services

    for name in ["a", "b", "c", "d"]:
        services.create_team(team_id=name)
        services.set_team_limit(
            team_id=name,
            model_id="chat-7b",
            tokens_per_minute=10,
            max_concurrency=1,
            guaranteed_share=0.1,
        )
    # Auth (token lookup + last-used update) + teams + prefetched limits.
    with django_assert_max_num_queries(4):
        response = admin_client.get("/admin/teams")
    assert len(response.json()["data"]) == 4


# --- pool state -----------------------------------------------------------------------


def test_pool_state_schema_names_the_fields_the_api_returns(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    from control.api.serializers import (
        PoolStateSerializer,
        ReplicaStateSerializer,
    )

    ReplicaFactory(version=chat_v1, last_heartbeat=timezone.now())
    data = admin_client.get("/admin/pools/chat-7b/state").json()
    assert set(PoolStateSerializer().fields) == set(data)
    assert set(ReplicaStateSerializer().fields) == set(data["replicas"][0])


def test_pool_state_sums_serving_replicas(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    now = timezone.now()
    ReplicaFactory(
        version=chat_v1, queue_depth=2, tokens_in_flight=5000, last_heartbeat=now
    )
    ReplicaFactory(
        version=chat_v1, queue_depth=1, tokens_in_flight=3000, last_heartbeat=now
    )
    ReplicaFactory(
        version=chat_v1, state="loading", tokens_in_flight=999, last_heartbeat=now
    )
    ReplicaFactory(
        version=chat_v1, state="gone", tokens_in_flight=777, last_heartbeat=now
    )
    data = admin_client.get("/admin/pools/chat-7b/state").json()
    assert data["queue_depth"] == 3
    assert data["tokens_in_flight"] == 8000
    assert len(data["replicas"]) == 3  # gone replicas are not listed
    assert data["prefix_hit_rate"] is None


def test_pool_state_leaves_silent_replicas_out_of_the_sums(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    from datetime import timedelta

    now = timezone.now()
    ReplicaFactory(version=chat_v1, tokens_in_flight=5000, last_heartbeat=now)
    ReplicaFactory(
        version=chat_v1,
        tokens_in_flight=4000,
        last_heartbeat=now - timedelta(seconds=10),
    )
    data = admin_client.get("/admin/pools/chat-7b/state").json()
    assert data["tokens_in_flight"] == 5000
    assert sorted(r["is_silent"] for r in data["replicas"]) == [False, True]


def test_pool_state_prefix_hit_rate_is_the_pools_live_figures(
    admin_client: APIClient, chat_v1: ModelVersion, team: Team
) -> None:
    """The hit rate is the gateways' live figures (role ``pool``), not the minute
    usage rows, which trail the flush and know no region."""
    minute = timezone.now().replace(second=0, microsecond=0)
    Usage.objects.create(
        team=team,
        model_id="chat-7b",
        version=chat_v1,
        minute=minute,
        prompt_tokens=1200,
        cached_tokens=800,
        output_tokens=300,
        requests=1,
    )
    assert (
        admin_client.get("/admin/pools/chat-7b/state").json()["prefix_hit_rate"] is None
    )
    VersionFigure.objects.create(
        model_id="chat-7b",
        version=chat_v1.version,
        role="pool",
        region="eu",
        bucket_start=minute,
        bucket_s=60,
        requests=1,
        answered=1,
        prompt_tokens=1000,
        cached_tokens=250,
    )
    data = admin_client.get("/admin/pools/chat-7b/state").json()
    assert data["prefix_hit_rate"] == pytest.approx(0.25)


def test_pool_state_filters_by_region(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    now = timezone.now()
    ReplicaFactory(version=chat_v1, region="eu", tokens_in_flight=1, last_heartbeat=now)
    ReplicaFactory(version=chat_v1, region="us", tokens_in_flight=2, last_heartbeat=now)
    data = admin_client.get("/admin/pools/chat-7b/state?region=us").json()
    assert data["tokens_in_flight"] == 2
    assert [r["region"] for r in data["replicas"]] == ["us"]


def test_pool_state_unknown_model_is_404(admin_client: APIClient) -> None:
    assert_error(
        admin_client.get("/admin/pools/nope/state"), 404, "not_found_error", "model"
    )


def test_pool_state_query_count_does_not_grow_with_replicas(
    admin_client: APIClient,
    chat_v1: ModelVersion,
    django_assert_max_num_queries: DjangoAssertNumQueries,
) -> None:
    now = timezone.now()
    for _ in range(10):
        ReplicaFactory(version=chat_v1, last_heartbeat=now)
    with django_assert_max_num_queries(6):
        response = admin_client.get("/admin/pools/chat-7b/state")
    assert len(response.json()["replicas"]) == 10
    assert Replica.objects.count() == 10
