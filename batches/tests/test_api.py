"""The Files and Batch APIs against the real database and a real storage root."""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from accounts import services as accounts_services
from accounts.domain.keys import hash_secret
from accounts.models import ApiKey, Team
from audit.models import AuditEntry
from batches import runner, services
from batches.models import Batch, BatchLine
from batches.tests.conftest import jsonl, line

if TYPE_CHECKING:
    from pytest_django import Settings

    from models_registry.models import Model

pytestmark = pytest.mark.django_db


def upload(client: APIClient, content: bytes, purpose: str = "batch") -> Any:
    handle = io.BytesIO(content)
    handle.name = "input.jsonl"
    return client.post(
        "/v1/files", {"file": handle, "purpose": purpose}, format="multipart"
    )


def read(response: Any) -> bytes:
    """The whole body of a streamed answer (async: the view streams off the loop)."""

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in response.streaming_content])

    return async_to_sync(collect)()


def create(client: APIClient, **body: Any) -> Any:
    return client.post("/v1/batches", body, format="json")


def file_id_of(client: APIClient, content: bytes) -> str:
    answer = upload(client, content)
    assert answer.status_code == 200, answer.content
    return str(answer.json()["id"])


def test_a_file_and_a_batch_in_openais_shape(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    content = jsonl(line("a"), line("b"), "{not json", {"custom_id": "c", "body": {}})
    answer = upload(client_of, content)
    assert answer.status_code == 200
    uploaded = answer.json()
    assert uploaded["object"] == "file"
    assert uploaded["purpose"] == "batch"
    assert uploaded["bytes"] == len(content)
    assert read(client_of.get(f"/v1/files/{uploaded['id']}/content")) == content

    created = create(
        client_of,
        input_file_id=uploaded["id"],
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert created.status_code == 200, created.content
    batch = created.json()
    assert batch["object"] == "batch"
    assert batch["status"] == "in_progress"
    assert batch["model"] == "chat-7b"
    assert batch["metadata"] == {"job": "nightly"}
    # The two malformed lines failed at once; the rest wait for a runner.
    assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 2}
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    rows = list(BatchLine.objects.filter(batch_id=batch["id"]).order_by("index"))
    assert [(r.custom_id, r.status) for r in rows] == [
        ("a", "pending"),
        ("b", "pending"),
        ("", "failed"),
        ("c", "failed"),
    ]
    assert (rows[2].error or {})["code"] == "invalid_json"
    assert (rows[3].error or {})["code"] == "invalid_method"
    # The batch's own key exists, hashed, of purpose batch; its secret is derived.
    key = Batch.objects.get(pk=batch["id"]).key
    assert key is not None
    assert key.purpose == ApiKey.Purpose.BATCH
    assert services.batch_key_secret(batch["id"]) not in json.dumps(batch)
    assert client_of.get(f"/v1/batches/{batch['id']}").json()["id"] == batch["id"]


@pytest.mark.parametrize(
    ("rows", "code"),
    [
        ((line("a"), line("a")), "duplicate_custom_id"),
        ((line("a", model="chat-8b"), line("b")), "mixed_models"),
        (("",), "empty_file"),
    ],
)
def test_an_input_that_cannot_be_a_batch_is_a_400(
    store: Path,
    client_of: APIClient,
    chat_model: Model,
    rows: tuple[Any, ...],
    code: str,
) -> None:
    file_id = file_id_of(client_of, jsonl(*rows) if rows != ("",) else b"\n\n ")
    answer = create(client_of, input_file_id=file_id, completion_window="24h")
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == code
    assert not Batch.objects.exists()


def test_unknown_model_window_and_purpose_are_400s(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    unknown = file_id_of(client_of, jsonl(line("a", model="nope")))
    answer = create(client_of, input_file_id=unknown, completion_window="24h")
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "model_not_found"
    good = file_id_of(client_of, jsonl(line("a")))
    for window in ("1y", "", "0h", "8d", 24):
        answer = create(client_of, input_file_id=good, completion_window=window)
        assert answer.status_code == 400, window
        assert answer.json()["error"]["param"] == "completion_window"
    answer = upload(client_of, jsonl(line("a")), purpose="fine-tune")
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "purpose"
    answer = create(client_of, input_file_id="file-nothere", completion_window="24h")
    assert answer.status_code == 404


def test_a_model_whose_batch_tier_the_team_may_not_use_is_a_403(
    store: Path, client_of: APIClient, team: Team, chat_model: Model
) -> None:
    accounts_services.set_team_entitlement(
        team_id=team.team, model_id="chat-7b", tiers=["interactive", "standard"]
    )
    file_id = file_id_of(client_of, jsonl(line("a")))

    answer = create(client_of, input_file_id=file_id, completion_window="24h")

    assert answer.status_code == 403, answer.content
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("permission_error", "tier_not_entitled")
    assert not Batch.objects.exists()
    accounts_services.set_team_entitlement(
        team_id=team.team, model_id="chat-7b", tiers=["batch"]
    )
    answer = create(client_of, input_file_id=file_id, completion_window="24h")
    assert answer.status_code == 200, answer.content


def test_a_model_the_team_has_no_limits_on_is_a_403(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    accounts_services.create_team(team_id="other", name="Other")
    _, secret = accounts_services.issue_key(team_id="other")
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    file_id = file_id_of(other, jsonl(line("a")))

    answer = create(other, input_file_id=file_id, completion_window="24h")

    assert answer.status_code == 403, answer.content
    error = answer.json()["error"]
    assert error["type"] == "permission_error"
    assert error["code"] == "model_not_allowed"
    assert "chat-7b" in error["message"]
    assert "/admin/teams/other/limits" in error["message"]
    assert not Batch.objects.exists()


def test_the_seeds_form_reads_and_writes_only_under_the_roots(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    (store / "in.jsonl").write_bytes(jsonl(line("a"), line("b")))
    deadline = (timezone.now() + timedelta(hours=1)).isoformat()
    base = {
        "model": "chat-7b",
        "input_uri": f"file://{store}/in.jsonl",
        "output_uri": f"file://{store}/out.jsonl",
        "deadline": deadline,
    }
    for change, param in (
        ({"input_uri": "file:///etc/passwd"}, "input_uri"),
        ({"output_uri": "file:///tmp/out.jsonl"}, "output_uri"),
        ({"input_uri": f"file://{store}/../in.jsonl"}, "input_uri"),
        ({"input_uri": f"file://{store}/missing.jsonl"}, "input_uri"),
        ({"deadline": time.time() - 5}, "deadline"),
        ({"deadline": "tomorrow"}, "deadline"),
        ({"model": "nope"}, "model"),
        # A URL parser stops the path at '#' or '?'; fsspec would not.
        ({"output_uri": f"file://{store}/x#/../../../tmp/owned"}, "output_uri"),
        ({"input_uri": f"file://{store}/in.jsonl?/../x"}, "input_uri"),
        # Never over what exists, nor among the platform's own files.
        ({"output_uri": f"file://{store}/in.jsonl"}, "output_uri"),
        ({"output_uri": f"file://{store}/batches/files/x.jsonl"}, "output_uri"),
        ({"output_uri": "s3://bucket-not-a-root/out.jsonl"}, "output_uri"),
        ({"completion_window": "1h"}, "deadline"),
    ):
        answer = create(client_of, **{**base, **change})
        assert answer.status_code == 400, change
        assert answer.json()["error"]["param"] == param, answer.json()
    answer = create(client_of, **base)
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["batch_id"] == body["id"]
    assert body["request_counts"]["total"] == 2
    assert abs(body["deadline"] - timezone.now().timestamp() - 3600) < 60


def test_lines_the_database_cannot_hold_fail_alone(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    nul = json.dumps(line("nul", "a\u0000b"))
    nan = (
        '{"custom_id": "nan", "method": "POST", "url": "/v1/chat/completions", '
        '"body": {"model": "chat-7b", "messages": [], "temperature": NaN}}'
    )
    deep = '{"custom_id": "deep", "body": ' + "[" * 5000 + "]" * 5000 + "}"
    file_id = file_id_of(client_of, jsonl(line("ok"), nul, nan, deep))
    answer = create(client_of, input_file_id=file_id, completion_window="1h")
    assert answer.status_code == 200, answer.content
    assert answer.json()["request_counts"] == {"total": 4, "completed": 0, "failed": 3}
    failed = BatchLine.objects.filter(batch_id=answer.json()["id"], status="failed")
    assert {(x.error or {}).get("code") for x in failed} == {"invalid_json"}


def test_files_page_as_the_sdk_asks(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    made = [file_id_of(client_of, jsonl(line("a"))) for _ in range(3)]
    first = client_of.get("/v1/files?limit=2").json()
    assert [f["id"] for f in first["data"]] == made[::-1][:2]
    assert first["has_more"] is True
    rest = client_of.get(f"/v1/files?limit=2&after={first['last_id']}").json()
    assert ([f["id"] for f in rest["data"]], rest["has_more"]) == ([made[0]], False)
    oldest = client_of.get("/v1/files?order=asc&limit=1").json()
    assert oldest["data"][0]["id"] == made[0]
    for query in ("limit=%C2%B2", "limit=0", "order=sideways", "after=../x"):
        answer = client_of.get(f"/v1/files?{query}")
        assert answer.status_code == 400, query


def test_a_file_over_the_limit_is_a_413(
    store: Path, client_of: APIClient, chat_model: Model, settings: Settings
) -> None:
    settings.PLATFORM_BATCH_FILE_MAX_BYTES = 100
    answer = upload(client_of, jsonl(line("a"), line("b")))
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "file_too_large"
    assert not list((store / "batches" / "files").glob("*"))  # nothing left behind
    (store / "big.jsonl").write_bytes(jsonl(line("a"), line("b")))
    answer = create(
        client_of,
        model="chat-7b",
        input_uri=f"file://{store}/big.jsonl",
        output_uri=f"file://{store}/out.jsonl",
        deadline=time.time() + 600,
    )
    assert answer.status_code == 413


def test_a_team_sees_only_its_own(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    file_id = file_id_of(client_of, jsonl(line("a")))
    batch_id = create(client_of, input_file_id=file_id, completion_window="1h").json()[
        "id"
    ]
    accounts_services.create_team(team_id="other")
    _, secret = accounts_services.issue_key(team_id="other")
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    for path in (
        f"/v1/files/{file_id}",
        f"/v1/files/{file_id}/content",
        f"/v1/batches/{batch_id}",
    ):
        answer = other.get(path)
        assert answer.status_code == 404, path
        assert answer.json()["error"]["type"] == "not_found_error"
    assert other.post(f"/v1/batches/{batch_id}/cancel").status_code == 404
    assert other.get("/v1/batches").json()["data"] == []
    # The batch's own key opens the gateway only; no key, or an admin's, is a 401.
    minted = APIClient()
    minted.credentials(
        HTTP_AUTHORIZATION=f"Bearer {services.batch_key_secret(batch_id)}"
    )
    assert minted.get("/v1/batches").status_code == 401
    assert APIClient().get("/v1/batches").status_code == 401


def test_listing_pages_newest_first(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    file_id = file_id_of(client_of, jsonl(line("a")))
    made = [
        create(client_of, input_file_id=file_id, completion_window="1h").json()["id"]
        for _ in range(3)
    ]
    first = client_of.get("/v1/batches?limit=2").json()
    assert [b["id"] for b in first["data"]] == made[::-1][:2]
    assert first["has_more"] is True
    rest = client_of.get(f"/v1/batches?limit=2&after={first['last_id']}").json()
    assert [b["id"] for b in rest["data"]] == [made[0]]
    assert rest["has_more"] is False
    assert client_of.get("/v1/batches?limit=0").status_code == 400


def test_cancel_with_no_runner_ends_it_cancelled_with_every_line_reported(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    file_id = file_id_of(client_of, jsonl(line("a"), line("b"), line("c")))
    batch_id = create(client_of, input_file_id=file_id, completion_window="1h").json()[
        "id"
    ]
    # One line had finished before the cancel.
    BatchLine.objects.filter(batch_id=batch_id, custom_id="a").update(
        status="done", status_code=200, response={"ok": True}
    )
    Batch.objects.filter(pk=batch_id).update(completed=1)
    answer = client_of.post(f"/v1/batches/{batch_id}/cancel")
    assert answer.json()["status"] == "cancelling"
    # Nobody holds it: the dispatcher hands it to a runner, which ends it at once.
    assert runner.dispatch(enqueue=_run_now()) == {"started": 1}
    body = client_of.get(f"/v1/batches/{batch_id}").json()
    assert body["status"] == "cancelled"
    assert body["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    output = _lines(client_of, body["output_file_id"])
    assert [(o["custom_id"], o["response"]["status_code"]) for o in output] == [
        ("a", 200)
    ]
    errors = _lines(client_of, body["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("b", "batch_cancelled"),
        ("c", "batch_cancelled"),
    ]
    assert ApiKey.objects.get(name=f"batch {batch_id}").revoked_at is not None
    assert client_of.post(f"/v1/batches/{batch_id}/cancel").status_code == 400


def test_past_its_deadline_a_batch_expires_with_partial_output(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    (store / "in.jsonl").write_bytes(jsonl(line("a"), line("b")))
    batch_id = create(
        client_of,
        model="chat-7b",
        input_uri=f"file://{store}/in.jsonl",
        output_uri=f"file://{store}/out/results.jsonl",
        deadline=time.time() + 60,
    ).json()["id"]
    BatchLine.objects.filter(batch_id=batch_id, custom_id="b").update(
        status="done", status_code=200, response={"answer": 1}
    )
    Batch.objects.filter(pk=batch_id).update(completed=1)
    later = time.time() + 61
    assert runner.dispatch(now=later, enqueue=_run_now(clock=lambda: later)) == {
        "started": 1
    }
    body = client_of.get(f"/v1/batches/{batch_id}").json()
    assert body["status"] == "expired"
    assert body["expired_at"] is not None
    written = [
        json.loads(x)
        for x in (store / "out" / "results.jsonl").read_text().splitlines()
    ]
    assert [(w["custom_id"], (w["error"] or {}).get("code")) for w in written] == [
        ("a", "batch_expired"),
        ("b", None),
    ]


def test_dispatch_hands_an_active_batch_to_one_runner_at_a_time(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    file_id = file_id_of(client_of, jsonl(line("a")))
    batch_id = create(client_of, input_file_id=file_id, completion_window="1h").json()[
        "id"
    ]
    queued: list[str] = []

    def enqueue(batch_id: str) -> None:
        queued.append(batch_id)
        Batch.objects.filter(pk=batch_id).update(dispatched_at=timezone.now())

    assert runner.dispatch(enqueue=enqueue)["started"] == 1
    # Handed on already: not again until that runner had time to take the lease.
    assert runner.dispatch(enqueue=enqueue)["started"] == 0
    assert runner.dispatch(now=time.time() + 31, enqueue=enqueue)["started"] == 1
    assert queued == [batch_id, batch_id]


def test_team_files_are_written_0600_in_0700_directories(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    previous = os.umask(0o022)  # the usual umask, which let files out 0644
    try:
        file_id = file_id_of(client_of, jsonl(line("a"), line("b")))
        batch_id = create(
            client_of, input_file_id=file_id, completion_window="1h"
        ).json()["id"]
        client_of.post(f"/v1/batches/{batch_id}/cancel")
        assert runner.dispatch(enqueue=_run_now()) == {"started": 1}
    finally:
        os.umask(previous)
    body = client_of.get(f"/v1/batches/{batch_id}").json()
    assert body["status"] == "cancelled" and body["error_file_id"]

    files = [path for path in store.rglob("*") if path.is_file()]
    directories = [path for path in store.rglob("*") if path.is_dir()]
    assert len(files) >= 2  # the input and the error file at least
    assert {
        str(p.relative_to(store)): oct(p.stat().st_mode & 0o777) for p in files
    } == {str(p.relative_to(store)): "0o600" for p in files}
    assert directories
    assert {
        str(p.relative_to(store)): oct(p.stat().st_mode & 0o777) for p in directories
    } == {str(p.relative_to(store)): "0o700" for p in directories}


def _run_now(clock: Callable[[], float] = time.time) -> Callable[[str], None]:
    """Run the handed-on batch here, with a gateway that must not be called."""

    def never(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"no line should be sent ({request.url})")

    def run(batch_id: str) -> None:
        runner.run_batch(batch_id, clock=clock, transport=httpx.MockTransport(never))

    return run


def _lines(client: APIClient, file_id: str) -> list[dict[str, Any]]:
    answer = client.get(f"/v1/files/{file_id}/content")
    assert answer.status_code == 200
    return [json.loads(x) for x in read(answer).splitlines()]


def test_cancel_is_audited_once_with_the_teams_key(
    store: Path, client_of: APIClient, chat_model: Model, team_secret: str
) -> None:
    """The cancel is one entry naming the team's key; only what a cancel writes
    is watched, never the counts the batch's runner moves meanwhile."""
    file_id = file_id_of(client_of, jsonl(line("a"), line("b")))
    batch_id = create(client_of, input_file_id=file_id, completion_window="1h").json()[
        "id"
    ]
    assert not AuditEntry.objects.exists()  # a team's own data, not the control plane
    answer = client_of.post(f"/v1/batches/{batch_id}/cancel", REMOTE_ADDR="192.0.2.9")
    assert answer.status_code == 200, answer.content
    # The same cancel again changes nothing, and writes nothing.
    assert client_of.post(f"/v1/batches/{batch_id}/cancel").status_code == 200

    (entry,) = AuditEntry.objects.all()
    key = ApiKey.objects.get(key_hash=hash_secret(team_secret))
    assert (entry.object_type, entry.object_id) == ("batches.batch", batch_id)
    assert entry.action == "update"
    assert entry.changed_fields == ["cancelling_at", "status"]
    assert entry.before is not None
    assert entry.after is not None
    assert set(entry.after) == {"id", "status", "cancelling_at"}
    assert (entry.before["status"], entry.after["status"]) == (
        "in_progress",
        "cancelling",
    )
    assert entry.actor_kind == "api_key"
    assert entry.actor_id == str(key.pk)
    assert entry.actor_name == f"API key {key.prefix}… (unnamed) of search"
    assert (entry.source, entry.method, entry.remote_addr) == (
        "rest",
        "POST",
        "192.0.2.9",
    )
    assert team_secret not in json.dumps([entry.before, entry.after])


def test_console_cancel_is_audited_with_the_user(
    store: Path, client_of: APIClient, chat_model: Model
) -> None:
    file_id = file_id_of(client_of, jsonl(line("a")))
    batch_id = create(client_of, input_file_id=file_id, completion_window="1h").json()[
        "id"
    ]
    console = Client()
    console.force_login(get_user_model().objects.create_superuser(username="ops"))
    answer = console.post(
        "/console/batches/batch/",
        {"action": "cancel", "_selected_action": [batch_id]},
    )
    assert answer.status_code == 302
    assert Batch.objects.get(pk=batch_id).status == "cancelling"
    (entry,) = AuditEntry.objects.all()
    assert (entry.object_id, entry.actor_name, entry.source) == (
        batch_id,
        "ops",
        "console",
    )
    assert entry.changed_fields == ["cancelling_at", "status"]
