"""The version gates through the control plane: what registration queues, what the
gates' state says, who may re-run them, and what a version that is not ready may
not do (PUT .../rollout and .../alias answer 409 unless an admin overrides, and
the override is recorded)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.utils import timezone

from models_registry.models import GateRun, Model, ModelVersion
from rollouts.models import Rollout, VersionOverride
from tests.factories import accept, digest, version_body
from tests.test_admin_api import assert_error

if TYPE_CHECKING:
    from pytest_django import Settings
    from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db


@pytest.fixture
def candidate(admin_client: APIClient, chat_v1: ModelVersion) -> dict[str, object]:
    """Return chat-7b@v2 as registration answered, with v1 live."""
    assert (
        admin_client.put(
            "/admin/models/chat-7b/alias", {"version": "v1"}, format="json"
        ).status_code
        == 200
    )
    response = admin_client.post(
        "/admin/models/chat-7b/versions",
        version_body(weights_hash=digest("v2 weights")),
        format="json",
    )
    assert response.status_code == 201, response.content
    return response.json()


def test_registration_queues_one_pending_row_per_gate(
    candidate: dict[str, object],
) -> None:
    assert candidate["status"] == "registered"
    assert candidate["status_reason"] == "gates queued (attempt 1)"
    gates = candidate["gates"]
    assert isinstance(gates, dict)
    assert gates["attempt"] == 1
    assert [(g["gate"], g["state"]) for g in gates["gates"]] == [
        ("weights", "pending"),
        ("eval", "pending"),
        ("load_test", "pending"),
    ]
    assert {g["requested_by"] for g in gates["gates"]} == {"registration"}


def test_a_version_that_is_not_ready_may_not_take_a_canary(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    response = admin_client.put(
        "/admin/models/chat-7b/rollout",
        {"version": "v2", "stage": "canary", "percent": 10},
        format="json",
    )

    assert_error(response, 409, "conflict_error", "version")
    error = response.json()["error"]
    assert error["code"] == "version_not_ready"
    assert "chat-7b@v2 is registered: its gates have not passed" in error["message"]
    assert not Rollout.objects.filter(version__version="v2").exists()
    assert Model.objects.get(pk="chat-7b").canary_version_id is None


def test_a_version_that_is_not_ready_may_not_take_the_alias(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    response = admin_client.put(
        "/admin/models/chat-7b/alias", {"version": "v2"}, format="json"
    )

    assert_error(response, 409, "conflict_error", "version")
    live = Model.objects.get(pk="chat-7b").live_version
    assert live is not None and live.version == "v1"


def test_a_rejected_version_is_refused_with_the_gates_reason(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    ModelVersion.objects.filter(version="v2").update(
        status="rejected", status_reason="eval gate: maths drops 0.31"
    )
    response = admin_client.put(
        "/admin/models/chat-7b/rollout",
        {"version": "v2", "stage": "shadow", "percent": 1},
        format="json",
    )

    assert_error(response, 409, "conflict_error", "version")
    assert response.json()["error"]["message"].startswith(
        "chat-7b@v2 was rejected by its gates: eval gate: maths drops 0.31"
    )


def reject_v2(reason: str = "eval gate: maths drops 0.31") -> None:
    """End v2's first attempt as its eval gate failing."""
    GateRun.objects.filter(version__version="v2").update(state="failed")
    ModelVersion.objects.filter(version="v2").update(
        status="rejected", status_reason=reason
    )


def test_no_override_while_its_gates_run(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    response = admin_client.put(
        "/admin/models/chat-7b/rollout",
        {
            "version": "v2",
            "stage": "canary",
            "percent": 1,
            "override": {"reason": "cannot wait"},
        },
        format="json",
    )

    assert_error(response, 409, "conflict_error", "version")
    assert "its gates are running: wait for them" in response.json()["error"]["message"]
    assert not VersionOverride.objects.exists()


def test_an_override_lets_it_through_and_is_recorded(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    reject_v2()
    response = admin_client.put(
        "/admin/models/chat-7b/rollout",
        {
            "version": "v2",
            "stage": "canary",
            "percent": 1,
            "override": {"reason": "hotfix for incident 42; eval rerun tonight"},
        },
        format="json",
    )

    assert response.status_code == 200, response.content
    canary = Model.objects.get(pk="chat-7b").canary_version
    assert canary is not None and canary.version == "v2"
    override = VersionOverride.objects.get()
    assert override.version.version == "v2"
    assert (override.action, override.stage, override.percent) == (
        "rollout",
        "canary",
        1,
    )
    assert override.version_status == "rejected"
    assert override.reason == "hotfix for incident 42; eval rerun tonight"
    assert override.by.startswith("admin token sk-admin-")
    assert "was rejected by its gates: eval gate: maths drops 0.31" in override.refusal


def test_a_rejected_version_sent_live_by_an_override_goes_back_to_rejected(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    reject_v2()
    assert (
        admin_client.put(
            "/admin/models/chat-7b/alias",
            {"version": "v2", "override": {"reason": "incident 42"}},
            format="json",
        ).status_code
        == 200
    )
    assert ModelVersion.objects.get(version="v2").status == "live"

    back = admin_client.put(
        "/admin/models/chat-7b/alias", {"version": "v1"}, format="json"
    )

    assert back.status_code == 200, back.content
    assert ModelVersion.objects.get(version="v2").status == "rejected"
    again = admin_client.put(
        "/admin/models/chat-7b/rollout",
        {"version": "v2", "stage": "canary", "percent": 1},
        format="json",
    )
    assert_error(again, 409, "conflict_error", "version")


def test_an_override_needs_a_reason(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    response = admin_client.put(
        "/admin/models/chat-7b/alias",
        {"version": "v2", "override": {"reason": ""}},
        format="json",
    )

    assert_error(response, 400, "invalid_request_error")
    assert not VersionOverride.objects.exists()


def test_a_ready_version_needs_no_override(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    accept(ModelVersion.objects.get(version="v2"))

    response = admin_client.put(
        "/admin/models/chat-7b/rollout",
        {"version": "v2", "stage": "canary", "percent": 10},
        format="json",
    )

    assert response.status_code == 200, response.content
    assert not VersionOverride.objects.exists()


def test_gates_show_every_attempt_and_refuse_a_rerun_while_pending(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    url = "/admin/models/chat-7b/versions/v2/gates"

    history = admin_client.get(url)
    assert history.status_code == 200
    body = history.json()
    assert (body["model"], body["version"], body["status"]) == (
        "chat-7b",
        "v2",
        "registered",
    )
    assert [(r["attempt"], r["gate"]) for r in body["runs"]] == [
        (1, "weights"),
        (1, "eval"),
        (1, "load_test"),
    ]

    again = admin_client.post(url)
    assert_error(again, 409, "conflict_error", "version")
    assert "the gates of chat-7b@v2 are running" in again.json()["error"]["message"]


def test_a_rejected_version_may_run_its_gates_again(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    reject_v2()

    response = admin_client.post("/admin/models/chat-7b/versions/v2/gates")

    assert response.status_code == 202, response.content
    body = response.json()
    assert body["status"] == "registered"
    assert sorted({r["attempt"] for r in body["runs"]}) == [1, 2]
    second = [r for r in body["runs"] if r["attempt"] == 2]
    assert {r["state"] for r in second} == {"pending"}
    assert {r["requested_by"] for r in second} == {
        second[0]["requested_by"]
    } and second[0]["requested_by"].startswith("admin token ")


def test_an_abandoned_attempt_does_not_block_the_gates_for_ever(
    admin_client: APIClient, candidate: dict[str, object], settings: Settings
) -> None:
    """Its worker was killed: the rows stayed running. Past the gates' time limit
    a new attempt may start, and the old one says it was abandoned."""
    GateRun.objects.filter(version__version="v2", kind="weights").update(
        state="running"
    )
    old = timezone.now() - timedelta(seconds=settings.PLATFORM_GATE_TIME_LIMIT_S + 1)
    GateRun.objects.filter(version__version="v2").update(created_at=old)

    response = admin_client.post("/admin/models/chat-7b/versions/v2/gates")

    assert response.status_code == 202, response.content
    first = [r for r in response.json()["runs"] if r["attempt"] == 1]
    assert {r["state"] for r in first} == {"failed"}
    assert {r["detail"] for r in first} == {
        "abandoned: no worker finished it within the gates' time limit"
    }


def test_the_canary_does_not_run_its_gates_again(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    accept(ModelVersion.objects.get(version="v2"))
    assert (
        admin_client.put(
            "/admin/models/chat-7b/rollout",
            {"version": "v2", "stage": "canary", "percent": 5},
            format="json",
        ).status_code
        == 200
    )

    response = admin_client.post("/admin/models/chat-7b/versions/v2/gates")

    assert_error(response, 409, "conflict_error", "version")
    assert "is the model's canary" in response.json()["error"]["message"]


def test_a_live_version_does_not_run_its_gates_again(
    admin_client: APIClient, candidate: dict[str, object]
) -> None:
    response = admin_client.post("/admin/models/chat-7b/versions/v1/gates")

    assert_error(response, 409, "conflict_error", "version")
    assert "is live" in response.json()["error"]["message"]


def test_gates_of_an_unknown_version_are_404(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    assert_error(
        admin_client.get("/admin/models/chat-7b/versions/v9/gates"),
        404,
        "not_found_error",
        "version",
    )
    assert_error(
        admin_client.post("/admin/models/chat-7b/versions/nope/gates"),
        400,
        "invalid_request_error",
        "version",
    )


def test_gate_config_reads_the_defaults_and_takes_changes(
    admin_client: APIClient, chat_v1: ModelVersion
) -> None:
    url = "/admin/models/chat-7b/gate_config"
    assert admin_client.get(url).json()["judge_model"] == "reason-70b"

    response = admin_client.put(
        url, {"thresholds": {"maths": 0.02}, "judge_model": "judge-1"}, format="json"
    )

    assert response.status_code == 200, response.content
    body = admin_client.get(url).json()
    assert body["thresholds"]["maths"] == 0.02
    assert body["thresholds"]["reasoning"] == 0.05
    assert body["judge_model"] == "judge-1"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"thresholds": {"poetry": 0.1}}, "gate_config.thresholds"),
        ({"min_kappa": "high"}, "gate_config.min_kappa"),
        ({"surprise": 1}, "gate_config.surprise"),
        (
            {"eval_set_uri": "https://evil.example/set.jsonl"},
            "gate_config.eval_set_uri",
        ),
        ([1, 2], None),
    ],
)
def test_gate_config_refuses_what_makes_no_sense(
    admin_client: APIClient, chat_v1: ModelVersion, body: object, param: str | None
) -> None:
    response = admin_client.put(
        "/admin/models/chat-7b/gate_config", body, format="json"
    )

    assert_error(response, 400, "invalid_request_error", param)
    assert Model.objects.get(pk="chat-7b").gate_config == {}
