"""The end-to-end tests' check of the audit trail: every admin write they make
is in it once, with their admin token.

Public surface: ``AdminCall``, ``AdminCalls``, ``AuditedApiClient``, ``admin_api``,
``check_trail``, ``trail_problems``.

``admin_api`` gives a test an httpx client with an admin token of its own; the
client sends every request with an ``X-Request-Id`` of its own (``AdminCalls``)
and notes each POST, PUT, PATCH or DELETE under /admin/ that succeeded. When the
client is done, the entries written under those ids are read back from the
database and checked (``trail_problems``): each names the token, the method and
the path; no object has two entries of one action for one request; a 201 has at
least one entry. A request that changed nothing (the same change again) may have
none. The ``admin_client`` fixture (conftest.py) is an ``AuditedApiClient``,
checked the same way when its test ends.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from rest_framework.test import APIClient

from accounts import services as accounts_services
from audit.models import AuditEntry

if TYPE_CHECKING:
    from pytest_django import DjangoDbBlocker

__all__ = [
    "AdminCall",
    "AdminCalls",
    "AuditedApiClient",
    "admin_api",
    "check_trail",
    "trail_problems",
]

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
HEADER = "x-request-id"


@dataclass(frozen=True, slots=True)
class AdminCall:
    """One admin write that succeeded: the id it was sent with, and the one it
    was answered with (which its entries carry)."""

    method: str
    path: str
    status: int
    request_id: str
    answered_id: str | None


class Entry(Protocol):
    """What the check reads of an audit entry (``AuditEntry`` has it)."""

    x_request_id: str
    actor_kind: str
    actor_id: str
    method: str
    path: str
    object_type: str
    object_id: str
    action: str


class AdminCalls:
    """The event hooks of an httpx client: an id on every request, and a note of
    every admin write that succeeded (from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: list[AdminCall] = []

    def on_request(self, request: httpx.Request) -> None:
        if HEADER not in request.headers:
            request.headers[HEADER] = f"e2e-{uuid.uuid4().hex}"

    def on_response(self, response: httpx.Response) -> None:
        request = response.request
        path = request.url.path
        if request.method not in WRITES or not path.startswith("/admin/"):
            return
        if not 200 <= response.status_code < 300:
            return
        call = AdminCall(
            method=request.method,
            path=path,
            status=response.status_code,
            request_id=request.headers[HEADER],
            answered_id=response.headers.get(HEADER),
        )
        with self._lock:
            self.calls.append(call)


def trail_problems(
    calls: Sequence[AdminCall], entries: Iterable[Entry], *, token_id: int
) -> list[str]:
    """Return what is wrong with the trail of ``calls`` made with admin token
    ``token_id``, given the entries written under their ids (empty: nothing)."""
    by_id: dict[str, list[Entry]] = defaultdict(list)
    for entry in entries:
        by_id[entry.x_request_id].append(entry)
    problems = []
    for call in calls:
        said = f"{call.method} {call.path} ({call.status}, {call.request_id})"
        # The id the server answered with is the one it stored: the one sent,
        # unless that was no short token (config.request_ids).
        if not call.answered_id:
            problems.append(f"{said}: answered with no {HEADER}")
        found = by_id.get(call.answered_id or "", [])
        if call.status == 201 and not found:
            problems.append(f"{said}: created something, but the trail has no entry")
        for entry in found:
            if (entry.actor_kind, entry.actor_id) != ("admin_token", str(token_id)):
                problems.append(
                    f"{said}: {entry.object_type} {entry.object_id} is put on "
                    f"{entry.actor_kind} {entry.actor_id}, not admin token {token_id}"
                )
            if (entry.method, entry.path) != (call.method, call.path):
                problems.append(
                    f"{said}: an entry names {entry.method} {entry.path} instead"
                )
        twice = Counter((e.object_type, e.object_id, e.action) for e in found)
        problems.extend(
            f"{said}: {kind} {object_id} {action} is recorded {n} times"
            for (kind, object_id, action), n in sorted(twice.items())
            if n > 1
        )
    return problems


class AuditedApiClient(APIClient):
    """DRF's test client, noting its admin writes as ``AdminCalls`` does (each
    request sent with an ``X-Request-Id`` of its own unless it names one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admin_calls: list[AdminCall] = []

    def request(self, **kwargs: Any) -> Any:
        request_id = kwargs.setdefault("HTTP_X_REQUEST_ID", f"t-{uuid.uuid4().hex}")
        response = super().request(**kwargs)
        method, path = kwargs.get("REQUEST_METHOD", ""), kwargs.get("PATH_INFO", "")
        if (
            method in WRITES
            and path.startswith("/admin/")
            and 200 <= response.status_code < 300
        ):
            self.admin_calls.append(
                AdminCall(
                    method=method,
                    path=path,
                    status=response.status_code,
                    request_id=request_id,
                    answered_id=response.headers.get(HEADER),
                )
            )
        return response


def check_trail(calls: Sequence[AdminCall], *, token_id: int) -> None:
    """Fail unless the trail of ``calls`` is as it should be (``trail_problems``)."""
    ids = [call.answered_id for call in calls if call.answered_id]
    entries = list(AuditEntry.objects.filter(x_request_id__in=ids))
    problems = trail_problems(calls, entries, token_id=token_id)
    assert not problems, "the audit trail is wrong:\n" + "\n".join(problems)


@contextmanager
def admin_api(
    base_url: str, *, name: str, blocker: DjangoDbBlocker | None = None
) -> Iterator[httpx.Client]:
    """Yield a client of ``base_url`` with a new admin token named ``name``; when
    it is done, fail unless its admin writes are in the audit trail as they
    should be (``trail_problems``). ``blocker`` opens the database to a test
    that does not hold it."""

    def database() -> AbstractContextManager[None]:
        return blocker.unblock() if blocker is not None else nullcontext()

    with database():
        token, secret = accounts_services.create_admin_token(name=name)
    calls = AdminCalls()
    with httpx.Client(
        base_url=base_url,
        headers={"Authorization": f"Bearer {secret}"},
        timeout=30,
        event_hooks={"request": [calls.on_request], "response": [calls.on_response]},
    ) as client:
        yield client
    with database():
        check_trail(calls.calls, token_id=token.pk)
