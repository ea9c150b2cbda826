"""The end-to-end tests' audit trail check (``tests.audit_check``) can fail: a
write with no entry, an entry of another actor, an object recorded twice."""

from __future__ import annotations

from dataclasses import dataclass, replace

import httpx

from tests.audit_check import AdminCall, AdminCalls, trail_problems

TOKEN_ID = 7
CALL = AdminCall(
    method="POST",
    path="/admin/teams",
    status=201,
    request_id="e2e-1",
    answered_id="e2e-1",
)


@dataclass
class FakeEntry:
    x_request_id: str = "e2e-1"
    actor_kind: str = "admin_token"
    actor_id: str = str(TOKEN_ID)
    method: str = "POST"
    path: str = "/admin/teams"
    object_type: str = "accounts.team"
    object_id: str = "ads"
    action: str = "create"


def test_trail_problems_passes_one_entry_per_object_with_the_token() -> None:
    entries = [FakeEntry(), FakeEntry(object_type="accounts.teamlimit", object_id="3")]
    assert trail_problems([CALL], entries, token_id=TOKEN_ID) == []


def test_trail_problems_fails_a_create_with_no_entry() -> None:
    unlinked = FakeEntry(x_request_id="someone-else")
    (problem,) = trail_problems([CALL], [unlinked], token_id=TOKEN_ID)
    assert "POST /admin/teams (201, e2e-1): created something" in problem


def test_trail_problems_lets_a_request_that_changed_nothing_have_none() -> None:
    again = replace(CALL, method="PUT", path="/admin/models/chat-7b/alias", status=200)
    assert trail_problems([again], [], token_id=TOKEN_ID) == []


def test_trail_problems_fails_an_entry_put_on_another_actor() -> None:
    (problem,) = trail_problems(
        [CALL], [FakeEntry(actor_kind="user", actor_id="1")], token_id=TOKEN_ID
    )
    assert "accounts.team ads is put on user 1, not admin token 7" in problem


def test_trail_problems_fails_an_object_recorded_twice_for_one_request() -> None:
    (problem,) = trail_problems([CALL], [FakeEntry(), FakeEntry()], token_id=TOKEN_ID)
    assert "accounts.team ads create is recorded 2 times" in problem


def test_trail_problems_fails_an_entry_of_another_path() -> None:
    (problem,) = trail_problems(
        [CALL], [FakeEntry(path="/admin/models")], token_id=TOKEN_ID
    )
    assert "an entry names POST /admin/models instead" in problem


def test_trail_problems_links_by_the_id_answered() -> None:
    """The server replaces an id that is no short token: its entries carry the
    one it answered with; an answer with none cannot be linked."""
    replaced = replace(CALL, request_id="two words", answered_id="e2e-1")
    assert trail_problems([replaced], [FakeEntry()], token_id=TOKEN_ID) == []
    problems = trail_problems(
        [replace(CALL, answered_id=None)], [FakeEntry()], token_id=TOKEN_ID
    )
    assert len(problems) == 2
    assert "answered with no x-request-id" in problems[0]
    assert "created something, but the trail has no entry" in problems[1]


def test_admin_calls_label_every_request_and_note_admin_writes_that_succeeded() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        status = 400 if request.url.path.endswith("/bad") else 201
        return httpx.Response(
            status, headers={"x-request-id": request.headers["x-request-id"]}
        )

    calls = AdminCalls()
    with httpx.Client(
        base_url="http://platform",
        transport=httpx.MockTransport(answer),
        event_hooks={"request": [calls.on_request], "response": [calls.on_response]},
    ) as client:
        client.post("/admin/teams", json={})
        client.post("/admin/bad", json={})
        client.get("/admin/models")
        client.post("/v1/batches", json={})
        client.put("/admin/models/x/alias", json={}, headers={"x-request-id": "mine"})
    assert [(c.method, c.path, c.status) for c in calls.calls] == [
        ("POST", "/admin/teams", 201),
        ("PUT", "/admin/models/x/alias", 201),
    ]
    assert calls.calls[0].request_id.startswith("e2e-")
    assert calls.calls[0].answered_id == calls.calls[0].request_id
    assert calls.calls[1].request_id == "mine"
