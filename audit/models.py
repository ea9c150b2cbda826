"""The audit trail: one row per control-plane object changed, with its actor."""

from __future__ import annotations

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models


class ActorKind(models.TextChoices):
    """Who made a change: an admin token (the REST API), a console user, or a
    team's API key (its own batches, through the team API)."""

    ADMIN_TOKEN = "admin_token", "admin token"
    USER = "user", "console user"
    API_KEY = "api_key", "team API key"


class Source(models.TextChoices):
    """Where a change came in: the control-plane REST API or the console."""

    REST = "rest", "REST API"
    CONSOLE = "console", "console"


class Action(models.TextChoices):
    """What happened to the object."""

    CREATE = "create", "create"
    UPDATE = "update", "update"
    DELETE = "delete", "delete"


class AuditEntry(models.Model):
    """One object created, updated or deleted by one control-plane request.

    Append-only: on PostgreSQL a trigger refuses UPDATE and DELETE of these rows
    (migration 0002). Holds no foreign key, so deleting what it names never
    deletes it. ``before`` and ``after`` are the object's fields (secrets left
    out: ``audit.domain.changes.SECRET_FIELDS``); null before a create, after a
    delete. ``request_id`` groups the rows one request wrote; ``x_request_id`` is
    that request's ``X-Request-Id`` (``config.request_ids``: the caller's own, or
    the one it was answered with; "" in entries older than it), how a caller
    finds what its request changed.
    """

    Kind = ActorKind

    at = models.DateTimeField(db_index=True)
    actor_kind = models.CharField(max_length=16, choices=ActorKind.choices)
    actor_id = models.CharField(max_length=64)
    actor_name = models.CharField(max_length=200)
    remote_addr = models.GenericIPAddressField(null=True, blank=True)
    source = models.CharField(max_length=8, choices=Source.choices)
    method = models.CharField(max_length=8)
    path = models.CharField(max_length=500)
    request_id = models.UUIDField()
    x_request_id = models.CharField(max_length=64, blank=True, default="")
    object_type = models.CharField(max_length=100)
    object_id = models.CharField(max_length=200)
    action = models.CharField(max_length=8, choices=Action.choices)
    before = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    after = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    changed_fields = models.JSONField(default=list, blank=True)

    class Meta:
        db_table = "audit_entries"
        verbose_name = "audit entry"
        verbose_name_plural = "audit entries"
        ordering = ["-at", "-id"]
        indexes = [
            models.Index(fields=["object_type", "object_id"], name="audit_object"),
            models.Index(fields=["actor_name", "at"], name="audit_actor_at"),
            models.Index(fields=["x_request_id"], name="audit_x_request_id"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(action__in=[a.value for a in Action]),
                name="audit_action_known",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.actor_name} {self.action} {self.object_type} {self.object_id}"
