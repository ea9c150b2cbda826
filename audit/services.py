"""Record control-plane changes with their actor, and read the trail back.

A request that may change the control plane is wrapped in a ``Capture`` over the
querysets it may touch (its scope): the rows are read before and after, and every
row created, updated or deleted between the two becomes one ``AuditEntry``. Reading
rows, not catching ``save()``, is what sees the compare-and-set ``.update()`` calls
our services make (a key's revocation, a rollout's decision), which model signals
never see. The REST views (``audit.api.base.AuditedMixin``: every /admin write, a
batch's cancel), the console's admin pages (``audit.admin.AuditedAdmin``) and its
own pages that write (``audited``: rollout controls, judge labels) open the
captures; nothing else writes here. Design and limits:
docs/platform-admins.md#audit-trail.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, TypedDict

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError
from django.db.models import Model, QuerySet
from django.http import HttpRequest
from django.utils import timezone

from audit.domain.addresses import Network, client_address, parse_networks
from audit.domain.changes import RowKey, diff_rows
from audit.models import ActorKind, AuditEntry, Source

__all__ = [
    "Actor",
    "Capture",
    "EntryDict",
    "EntryFilter",
    "actor_from_request",
    "audited",
    "entry_dict",
    "filter_entries",
    "json_lines",
    "snapshot",
]

logger = logging.getLogger(__name__)

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class Actor:
    """Who sent a request, from where, and which request it was."""

    kind: str
    actor_id: str
    name: str
    remote_addr: str | None
    source: str
    method: str
    path: str
    x_request_id: str = ""


def actor_from_request(request: HttpRequest | Any, *, source: Source) -> Actor | None:
    """Return the request's actor: its admin token or team API key (prefix and
    name, never the secret) or its console user; None for a caller that is none.

    The address is ``REMOTE_ADDR``, or where that is one of
    ``PLATFORM_TRUSTED_PROXIES``, the client's that they forwarded
    (``audit.domain.addresses``).
    """
    meta = request.META
    remote_addr = client_address(
        str(meta.get("REMOTE_ADDR") or ""),
        str(meta.get("HTTP_X_FORWARDED_FOR") or ""),
        _trusted_proxies(tuple(settings.PLATFORM_TRUSTED_PROXIES)),
    )
    method = str(request.method or "")
    path = str(request.path)[:500]
    # Set by config.request_ids (a bounded token); cut for a request without it.
    x_request_id = str(meta.get("HTTP_X_REQUEST_ID") or "")[:64]
    token = getattr(request, "auth", None)
    prefix = getattr(token, "prefix", "")
    token_id = getattr(token, "pk", None)
    if prefix and token_id is not None:
        name = getattr(token, "name", "") or "unnamed"
        # A team's API key names its team; an admin token has none.
        team_id = getattr(token, "team_id", None)
        if team_id is not None:
            kind, label = ActorKind.API_KEY, f"API key {prefix}… ({name}) of {team_id}"
        else:
            kind, label = ActorKind.ADMIN_TOKEN, f"admin token {prefix}… ({name})"
        return Actor(
            kind=kind,
            actor_id=str(token_id),
            name=label[:200],
            remote_addr=remote_addr,
            source=source,
            method=method,
            path=path,
            x_request_id=x_request_id,
        )
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_authenticated", False):
        username = getattr(user, "get_username", lambda: "")()
        if username:
            return Actor(
                kind=ActorKind.USER,
                actor_id=str(user.pk),
                name=str(username)[:200],
                remote_addr=remote_addr,
                source=source,
                method=method,
                path=path,
                x_request_id=x_request_id,
            )
    return None


@lru_cache(maxsize=4)
def _trusted_proxies(cidrs: tuple[str, ...]) -> tuple[Network, ...]:
    return parse_networks(cidrs)


def _json_safe(row: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(row, cls=DjangoJSONEncoder))
    return loaded


def snapshot(scope: Iterable[QuerySet[Any]]) -> dict[RowKey, dict[str, Any]]:
    """Return every row of the scope's querysets: (type, id) -> its fields as JSON.

    The type is the model's ``app_label.modelname``; fields are by column name
    (``team_id``, not ``team``), so a snapshot never follows a foreign key. A
    queryset narrowed with ``.only(...)`` is read for those fields alone: a row
    that a control loop also writes is watched only where the request writes.
    """
    rows: dict[RowKey, dict[str, Any]] = {}
    for queryset in scope:
        model: type[Model] = queryset.model
        meta = model._meta
        names = _watched(queryset)
        for row in queryset.order_by().values(*names):
            key = (meta.label_lower, str(row[meta.pk.attname]))
            rows[key] = _json_safe(row)
    return rows


def _watched(queryset: QuerySet[Any]) -> list[str]:
    """Return the columns to read of ``queryset``: its ``.only()`` fields and the
    key, or every concrete field."""
    meta = queryset.model._meta
    only, is_defer = queryset.query.deferred_loading
    fields = meta.concrete_fields
    if not is_defer and only:
        fields = [
            f for f in fields if f.name in only or f.attname in only or f.primary_key
        ]
    return [field.attname for field in fields]


class Capture:
    """The rows a request may change, read before it runs and after it ends.

    ``finish`` writes one entry per changed row; a request that changed nothing
    (refused, or repeated) writes none. The entries are written after the
    request's own transactions, so they record what did commit, whatever the
    answer was.
    """

    def __init__(self, actor: Actor, scope: Sequence[QuerySet[Any]]) -> None:
        self.actor = actor
        self.scope = scope
        self.before = snapshot(scope)

    def finish(self) -> list[AuditEntry]:
        """Read the scope again and record what changed; return the entries."""
        changes = diff_rows(self.before, snapshot(self.scope))
        if not changes:
            return []
        now = timezone.now()
        request_id = uuid.uuid4()
        actor = self.actor
        return AuditEntry.objects.bulk_create(
            AuditEntry(
                at=now,
                actor_kind=actor.kind,
                actor_id=actor.actor_id,
                actor_name=actor.name,
                remote_addr=actor.remote_addr,
                source=actor.source,
                method=actor.method,
                path=actor.path,
                request_id=request_id,
                x_request_id=actor.x_request_id,
                object_type=change.object_type,
                object_id=change.object_id[:200],
                action=change.action,
                before=change.before,
                after=change.after,
                changed_fields=list(change.changed_fields),
            )
            for change in changes
        )

    def finish_quietly(self, exc: BaseException) -> None:
        """Finish after the request raised ``exc``; a database that is gone
        too is logged, so that the request's own error is the one raised."""
        try:
            self.finish()
        except DatabaseError:
            logger.exception(
                "audit: could not record %s %s after %r",
                self.actor.method,
                self.actor.path,
                exc,
            )


@contextmanager
def audited(
    request: HttpRequest | Any, *, source: Source, scope: Sequence[QuerySet[Any]]
) -> Iterator[None]:
    """Record what the block changes in ``scope`` as done by the request's actor
    (nothing for a read, or for a request with no actor)."""
    actor = _write_actor(request, source)
    if actor is None:
        yield
        return
    capture = Capture(actor, scope)
    try:
        yield
    except BaseException as exc:
        capture.finish_quietly(exc)
        raise
    capture.finish()


def _write_actor(request: HttpRequest | Any, source: Source) -> Actor | None:
    """Return the actor of a request that may write (not GET, HEAD, OPTIONS)."""
    if request.method in _SAFE_METHODS:
        return None
    return actor_from_request(request, source=source)


class EntryDict(TypedDict):
    """An audit entry as the API and the export write it."""

    id: int
    at: str
    actor_kind: str
    actor_id: str
    actor_name: str
    remote_addr: str | None
    source: str
    method: str
    path: str
    request_id: str
    x_request_id: str
    object_type: str
    object_id: str
    action: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    changed_fields: list[str]


def entry_dict(entry: AuditEntry) -> EntryDict:
    """Return an entry as one JSON object."""
    return {
        "id": entry.pk,
        "at": entry.at.isoformat(),
        "actor_kind": entry.actor_kind,
        "actor_id": entry.actor_id,
        "actor_name": entry.actor_name,
        "remote_addr": entry.remote_addr,
        "source": entry.source,
        "method": entry.method,
        "path": entry.path,
        "request_id": str(entry.request_id),
        "x_request_id": entry.x_request_id,
        "object_type": entry.object_type,
        "object_id": entry.object_id,
        "action": entry.action,
        "before": entry.before,
        "after": entry.after,
        "changed_fields": list(entry.changed_fields),
    }


@dataclass(frozen=True, slots=True)
class EntryFilter:
    """Which entries to read: each given field narrows the trail."""

    actor: str | None = None
    object_type: str | None = None
    object_id: str | None = None
    x_request_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    after_id: int | None = None


def filter_entries(query: EntryFilter) -> QuerySet[AuditEntry]:
    """Return the entries that ``query`` selects, in the order they were written.

    ``actor`` matches the actor's name exactly (``admin token pk_ab12… (ci)``, a
    console user's username); ``since`` is inclusive, ``until`` exclusive.
    """
    entries = AuditEntry.objects.order_by("id")
    if query.actor is not None:
        entries = entries.filter(actor_name=query.actor)
    if query.object_type is not None:
        entries = entries.filter(object_type=query.object_type)
    if query.object_id is not None:
        entries = entries.filter(object_id=query.object_id)
    if query.x_request_id is not None:
        entries = entries.filter(x_request_id=query.x_request_id)
    if query.after_id is not None:
        entries = entries.filter(id__gt=query.after_id)
    if query.since is not None:
        entries = entries.filter(at__gte=query.since)
    if query.until is not None:
        entries = entries.filter(at__lt=query.until)
    return entries


def json_lines(entries: Iterable[AuditEntry]) -> Iterator[str]:
    """Yield each entry as one line of JSON, newline included."""
    for entry in entries:
        yield json.dumps(entry_dict(entry), sort_keys=True, ensure_ascii=False) + "\n"
