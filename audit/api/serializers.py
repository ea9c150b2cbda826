"""The audit trail's shapes in the control-plane schema (inline: ``source`` and
``data`` are names a serializer class keeps for itself)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers

from audit.models import Action, ActorKind, Source

__all__ = ["audit_entries", "audit_page"]


def _entry_fields() -> dict[str, serializers.Field[Any, Any, Any, Any]]:
    return {
        "id": serializers.IntegerField(),
        "at": serializers.DateTimeField(),
        "actor_kind": serializers.ChoiceField(choices=ActorKind.choices),
        "actor_id": serializers.CharField(),
        "actor_name": serializers.CharField(),
        "remote_addr": serializers.IPAddressField(allow_null=True),
        "source": serializers.ChoiceField(choices=Source.choices),
        "method": serializers.CharField(),
        "path": serializers.CharField(),
        "request_id": serializers.UUIDField(),
        "x_request_id": serializers.CharField(allow_blank=True),
        "object_type": serializers.CharField(),
        "object_id": serializers.CharField(),
        "action": serializers.ChoiceField(choices=Action.choices),
        "before": serializers.DictField(allow_null=True),
        "after": serializers.DictField(allow_null=True),
        "changed_fields": serializers.ListField(child=serializers.CharField()),
    }


# One class, so that both answers name the same component.
_ENTRY_CLASS = inline_serializer("AuditEntry", _entry_fields()).__class__


def audit_entries() -> Any:
    """Return the schema of a list of entries (``audit.services.EntryDict``)."""
    return _ENTRY_CLASS(many=True)


def audit_page() -> Any:
    """Return the schema of a page of the trail: its entries, oldest first, and
    ``next_after_id`` to continue it (null at the end)."""
    return inline_serializer(
        "AuditPage",
        {
            "data": audit_entries(),
            "next_after_id": serializers.IntegerField(allow_null=True),
        },
    )
