"""Batch jobs: uploaded files, batches and their lines (seed: ``POST /v1/batches``).

A ``BatchFile`` is a team's JSONL file in the batch storage root (uploaded, or
written by the platform as a batch's output or errors). A ``Batch`` is one job on
one model with a deadline; its ``BatchLine`` rows are the unit of work and of
idempotency: a line is claimed by one runner at a time (``runner``), and its
result is written once, conditionally on that claim, so a line that finished is
never run again and none is lost when a runner dies (``batches.runner``).
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class BatchFile(models.Model):
    """A file of the Files API (purpose ``batch`` in, ``batch_output`` out)."""

    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    id = models.CharField(primary_key=True, max_length=40, editable=False)
    team = models.ForeignKey(
        "accounts.Team", on_delete=models.CASCADE, related_name="+"
    )
    purpose = models.CharField(max_length=16, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    uri = models.CharField(max_length=1024, help_text="Where the content is stored.")
    created_at = models.DateTimeField()

    class Meta:
        db_table = "batch_files"
        verbose_name = "batch file"
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["team", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"


class Batch(models.Model):
    """One batch job: its lines run through the gateway at the batch tier."""

    class Status(models.TextChoices):
        VALIDATING = "validating"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        FAILED = "failed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    id = models.CharField(primary_key=True, max_length=40, editable=False)
    team = models.ForeignKey(
        "accounts.Team", on_delete=models.CASCADE, related_name="+"
    )
    model = models.ForeignKey(
        "models_registry.Model", on_delete=models.PROTECT, related_name="+"
    )
    endpoint = models.CharField(max_length=64, default="/v1/chat/completions")
    completion_window = models.CharField(max_length=16)
    metadata = models.JSONField(default=dict, blank=True)
    input_file = models.ForeignKey(
        BatchFile, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    output_file = models.ForeignKey(
        BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    error_file = models.ForeignKey(
        BatchFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # The seed's form: where the lines were read from and every result is written.
    input_uri = models.CharField(max_length=1024, blank=True)
    output_uri = models.CharField(max_length=1024, blank=True)
    status = models.CharField(
        max_length=16, choices=Status.choices, default=Status.VALIDATING
    )
    errors = models.JSONField(default=list, blank=True)
    # How a finalising batch ends (completed, expired, cancelled).
    ending = models.CharField(max_length=16, blank=True)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    # Lines the gateway refused (503 shed, 429) and that went back to wait: how
    # often the job paused for other traffic.
    refused = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()
    deadline_at = models.DateTimeField(help_text="created_at + completion_window.")
    in_progress_at = models.DateTimeField(null=True, blank=True)
    # When a runner first sent a line: the scheduler judges the rate from here.
    started_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # The scheduler's latest decision (``batches.domain.scheduler``).
    priority = models.CharField(max_length=16, default="batch")
    at_risk = models.BooleanField(default=False)
    at_risk_since = models.DateTimeField(null=True, blank=True)
    projected_finish_at = models.DateTimeField(null=True, blank=True)
    schedule_reason = models.CharField(max_length=300, blank=True)
    escalated_at = models.DateTimeField(null=True, blank=True)
    # The runner holding the job (one at a time) and until when its lease holds.
    runner = models.CharField(max_length=64, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    key = models.ForeignKey(
        "accounts.ApiKey",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="The key the platform minted for this job's lines.",
    )

    class Meta:
        db_table = "batches"
        verbose_name_plural = "batches"
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["team", "-created_at"]),
            models.Index(fields=["status"]),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(completed__lte=models.F("total"))
                & Q(failed__lte=models.F("total")),
                name="batch_counts_within_total",
            ),
        ]

    ACTIVE = (Status.IN_PROGRESS, Status.CANCELLING)
    ENDED = (Status.COMPLETED, Status.FAILED, Status.EXPIRED, Status.CANCELLED)

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"


class BatchLine(models.Model):
    """One request of a batch; its result is written once."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"  # answered 2xx: the output file
        FAILED = "failed"  # answered otherwise, or malformed: the error file
        EXPIRED = "expired"
        CANCELLED = "cancelled"

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    index = models.PositiveIntegerField()
    # Empty for a malformed line that had no usable custom_id.
    custom_id = models.CharField(max_length=512, blank=True)
    body = models.JSONField(null=True, blank=True)
    status = models.CharField(
        max_length=16, choices=Status.choices, default=Status.PENDING
    )
    runner = models.CharField(max_length=64, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    tier = models.CharField(max_length=16, blank=True)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    response = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    tokens = models.PositiveIntegerField(default=0)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "batch_lines"
        ordering = ["batch", "index"]
        constraints = [
            models.UniqueConstraint(
                fields=["batch", "index"], name="batch_line_index_unique"
            ),
            models.UniqueConstraint(
                fields=["batch", "custom_id"],
                condition=~Q(custom_id=""),
                name="batch_line_custom_id_unique",
            ),
        ]
        indexes = [models.Index(fields=["batch", "status", "index"])]

    def __str__(self) -> str:
        return f"{self.batch_id}#{self.index}"
