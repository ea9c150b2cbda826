"""What changed between two snapshots of the rows a control-plane request could touch.

Public surface: ``Change``, ``diff_rows``, ``redact``.

A snapshot maps ``(object_type, object_id)`` to the row's fields (JSON values). A row
only in the after snapshot was created, one only in the before snapshot deleted, one
in both with a field that differs updated. Fields the platform writes on its own
(``IGNORED_FIELDS``: a key's last use, ``updated_at``) never make a change alone, so
a gateway's key-use flush that lands during a request is not put on the admin.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

__all__ = [
    "IGNORED_FIELDS",
    "SECRET_FIELDS",
    "Change",
    "RowKey",
    "diff_rows",
    "redact",
]

# Never recorded, under any table: a key's or token's SHA-256, a user's password hash.
SECRET_FIELDS = frozenset({"key_hash", "password"})
# Written by the platform itself, not by the admin who changed the row.
IGNORED_FIELDS = frozenset(
    {"last_used_at", "updated_at", "last_login", "autoscaler_state"}
)

RowKey: TypeAlias = tuple[str, str]
Fields: TypeAlias = Mapping[str, Any]
Action: TypeAlias = Literal["create", "update", "delete"]


@dataclass(frozen=True, slots=True)
class Change:
    """One row's change: its type and id, the action, and the fields around it."""

    object_type: str
    object_id: str
    action: Action
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    changed_fields: tuple[str, ...]


def redact(
    fields: Fields, secret_names: Iterable[str] = SECRET_FIELDS
) -> dict[str, Any]:
    """Return ``fields`` without the secret ones (left out, not masked)."""
    secrets = frozenset(secret_names)
    return {name: value for name, value in fields.items() if name not in secrets}


def diff_rows(
    before: Mapping[RowKey, Fields], after: Mapping[RowKey, Fields]
) -> list[Change]:
    """Return the rows created, updated or deleted from ``before`` to ``after``,
    ordered by type and id; secret fields are left out of every snapshot, and an
    update that changed one names it in ``changed_fields`` (its value never)."""
    changes: list[Change] = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        old_fields = redact(old) if old is not None else None
        new_fields = redact(new) if new is not None else None
        if old_fields is None and new_fields is not None:
            action: Action = "create"
            changed = tuple(sorted(new_fields))
        elif new_fields is None and old_fields is not None:
            action = "delete"
            changed = tuple(sorted(old_fields))
        elif old is not None and new is not None:
            # Compared before redaction: a new password is named, never shown.
            changed = tuple(
                sorted(
                    name
                    for name in old.keys() | new.keys()
                    if old.get(name) != new.get(name)
                )
            )
            if not set(changed) - IGNORED_FIELDS:
                continue
            action = "update"
        else:  # pragma: no cover  (a key comes from one of the two maps)
            continue
        changes.append(
            Change(
                object_type=key[0],
                object_id=key[1],
                action=action,
                before=old_fields,
                after=new_fields,
                changed_fields=changed,
            )
        )
    return changes
