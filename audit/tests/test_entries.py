"""The trail once written: append-only on PostgreSQL, read back over REST and by
``manage.py audit_export`` as JSON lines, filtered."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from io import StringIO
from typing import TYPE_CHECKING, Any

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction

from audit.models import AuditEntry

if TYPE_CHECKING:
    from pytest_django import DjangoAssertNumQueries
    from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 6, 9, 0, tzinfo=UTC)


def entry(actor: str, object_type: str, minutes: int, **fields: Any) -> AuditEntry:
    return AuditEntry.objects.create(
        at=T0 + timedelta(minutes=minutes),
        actor_kind="user",
        actor_id="1",
        actor_name=actor,
        remote_addr="192.0.2.1",
        source="console",
        method="POST",
        path="/console/",
        request_id=uuid.uuid4(),
        object_type=object_type,
        object_id="7",
        action="update",
        before={"name": "a"},
        after={"name": "b"},
        changed_fields=["name"],
        **fields,
    )


@pytest.fixture
def trail() -> list[AuditEntry]:
    return [
        entry("alice", "accounts.team", 0),
        entry("bob", "accounts.apikey", 1),
        entry("alice", "accounts.apikey", 2),
    ]


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE audit_entries SET actor_name = 'mallory'",
        "DELETE FROM audit_entries",
    ],
)
def test_postgres_refuses_to_change_or_delete_an_entry(
    postgres: None, trail: list[AuditEntry], sql: str
) -> None:
    with (
        pytest.raises(DatabaseError, match="append-only"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(sql)
    assert set(AuditEntry.objects.values_list("actor_name", flat=True)) == {
        "alice",
        "bob",
    }
    assert AuditEntry.objects.count() == 3


def test_postgres_refuses_the_orm_too(postgres: None, trail: list[AuditEntry]) -> None:
    with pytest.raises(DatabaseError), transaction.atomic():
        AuditEntry.objects.filter(pk=trail[0].pk).delete()
    assert AuditEntry.objects.filter(pk=trail[0].pk).exists()


def test_api_lists_the_trail_oldest_first(
    admin_client: APIClient,
    trail: list[AuditEntry],
    django_assert_num_queries: DjangoAssertNumQueries,
) -> None:
    # Two for the token (find it, note its use), one for the page.
    with django_assert_num_queries(3):
        response = admin_client.get("/admin/audit")
    assert response.status_code == 200
    body = response.json()
    assert [e["id"] for e in body["data"]] == [e.pk for e in trail]
    assert body["next_after_id"] is None
    first = body["data"][0]
    assert first["actor_name"] == "alice"
    assert first["before"] == {"name": "a"}
    assert first["after"] == {"name": "b"}
    assert first["remote_addr"] == "192.0.2.1"


def test_api_filters_by_actor_type_and_time(
    admin_client: APIClient, trail: list[AuditEntry]
) -> None:
    def ids(query: str) -> list[int]:
        response = admin_client.get(f"/admin/audit?{query}")
        assert response.status_code == 200, response.content
        return [e["id"] for e in response.json()["data"]]

    assert ids("actor=alice") == [trail[0].pk, trail[2].pk]
    assert ids("object_type=accounts.apikey") == [trail[1].pk, trail[2].pk]
    assert ids("since=2026-12-06T09:01:00Z&until=2026-12-06T09:02:00Z") == [trail[1].pk]
    assert ids("actor=alice&object_type=accounts.apikey") == [trail[2].pk]


def test_api_pages_with_after_id(
    admin_client: APIClient, trail: list[AuditEntry]
) -> None:
    first = admin_client.get("/admin/audit?limit=2").json()
    assert [e["id"] for e in first["data"]] == [trail[0].pk, trail[1].pk]
    assert first["next_after_id"] == trail[1].pk
    rest = admin_client.get(f"/admin/audit?limit=2&after_id={trail[1].pk}").json()
    assert [e["id"] for e in rest["data"]] == [trail[2].pk]
    assert rest["next_after_id"] is None


def test_api_exports_json_lines(
    admin_client: APIClient, trail: list[AuditEntry]
) -> None:
    response = admin_client.get("/admin/audit?format=jsonl&actor=bob")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/jsonl")
    lines = response.content.decode().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [trail[1].pk]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("since=2026-13-01", "since"),
        ("until=yesterday", "until"),
        ("limit=0", "limit"),
        ("after_id=-1", "after_id"),
        ("format=csv", "format"),
        ("actor=" + "x" * 201, "actor"),
    ],
)
def test_api_refuses_malformed_filters(
    admin_client: APIClient, query: str, param: str
) -> None:
    response = admin_client.get(f"/admin/audit?{query}")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_api_needs_an_admin_token(anon_client: APIClient) -> None:
    assert anon_client.get("/admin/audit").status_code == 401


def test_audit_export_writes_json_lines(trail: list[AuditEntry]) -> None:
    out = StringIO()
    call_command("audit_export", "--actor", "alice", stdout=out)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["id"] for r in rows] == [trail[0].pk, trail[2].pk]
    assert rows[0]["at"] == T0.isoformat()
    assert rows[0]["changed_fields"] == ["name"]


def test_audit_export_filters_by_time(trail: list[AuditEntry]) -> None:
    out = StringIO()
    call_command("audit_export", "--since", "2026-12-06T09:02:00Z", stdout=out)
    assert [json.loads(line)["id"] for line in out.getvalue().splitlines()] == [
        trail[2].pk
    ]
