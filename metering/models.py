"""Usage: one row per team, model, version and minute (seed step 12); the rollout
guards' figures: one row per version, role, region and bucket."""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q

from metering.domain.figures import Role


class Usage(models.Model):
    """What a team used of one model version in one minute, as one region counted it.

    With Redis, each minute's totals accumulate in Redis and the flush writes them
    (never lowering a stored total), so running it twice or after a crash neither
    loses nor doubles a count. In the embedded mode each gateway process adds its
    drained counts with ``F()`` expressions. ``cached_tokens`` is the part of ``prompt_tokens`` served from
    the prefix cache. ``shed`` counts 503s, both kinds: admission shed the request's
    tier, or no replica could start an answer (``routing.request_meter`` says why
    one column); ``rate_limited`` counts 429s. Neither is in ``requests`` or tokens.
    ``batch_requests``, ``batch_prompt_tokens`` and ``batch_output_tokens`` are the
    part of ``requests``, ``prompt_tokens`` and ``output_tokens`` that was batch
    work (the batch tier, or a batch job's key at any tier).
    """

    team = models.ForeignKey(
        "accounts.Team", on_delete=models.PROTECT, related_name="+"
    )
    model = models.ForeignKey(
        "models_registry.Model", on_delete=models.PROTECT, related_name="+"
    )
    version = models.ForeignKey(
        "models_registry.ModelVersion", on_delete=models.PROTECT, related_name="+"
    )
    # The region whose gateways counted it: each region flushes its own Redis,
    # so a team served by two regions in one minute (a failover) has two rows.
    region = models.CharField(max_length=64, default="")
    minute = models.DateTimeField()
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)
    requests = models.PositiveBigIntegerField(default=0)
    shed = models.PositiveBigIntegerField(default=0)
    rate_limited = models.PositiveBigIntegerField(default=0)
    batch_requests = models.PositiveBigIntegerField(default=0)
    batch_prompt_tokens = models.PositiveBigIntegerField(default=0)
    batch_output_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        db_table = "usage"
        ordering = ["-minute", "team_id"]
        verbose_name_plural = "usage"
        permissions = [
            ("view_cost_report", "Can read usage and cost reports"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["team", "model", "version", "region", "minute"],
                name="usage_team_model_region_minute",
            ),
            models.CheckConstraint(
                condition=Q(cached_tokens__lte=F("prompt_tokens")),
                name="usage_cached_within_prompt",
            ),
            models.CheckConstraint(
                condition=Q(batch_requests__lte=F("requests")),
                name="usage_batch_requests_within_requests",
            ),
            models.CheckConstraint(
                condition=Q(batch_prompt_tokens__lte=F("prompt_tokens")),
                name="usage_batch_prompt_within_prompt",
            ),
            models.CheckConstraint(
                condition=Q(batch_output_tokens__lte=F("output_tokens")),
                name="usage_batch_output_within_output",
            ),
            models.CheckConstraint(
                condition=Q(minute__second=0), name="usage_minute_truncated"
            ),
        ]
        indexes = [
            models.Index(fields=["model", "minute"], name="usage_model_minute"),
            models.Index(fields=["team", "minute"], name="usage_team_minute"),
        ]

    def __str__(self) -> str:
        return f"{self.team_id} {self.model_id}@{self.version_id} {self.minute:%Y-%m-%d %H:%M}"


class VersionFigure(models.Model):
    """What one version did in one role, region and bucket of time (rollout guards).

    Written by the figures flush (``metering.services.flush_redis_figures``: the
    bucket's full totals, overwritten, so a second flush changes nothing; or, in
    the embedded mode, ``flush_memory_figures``, which adds). ``version`` is the
    label, as the guards ask for it. ``errors`` maps an error kind to its count,
    ``ttft`` and ``output`` map a histogram bucket (``metering.domain.figures``,
    as a string) to its count. ``conversations`` is the bucket's distinct count.
    Role ``pool`` rows are every pool's live figures (rollout or not); only they
    fill ``prompt_tokens``, ``cached_tokens`` and ``tpot`` (time per output token).
    ``judged`` maps a live-answer judge's outcome for the candidate (``win``,
    ``loss``, ``tie``, ``unreadable``) to its count: scores only, never text.
    """

    model = models.ForeignKey(
        "models_registry.Model", on_delete=models.PROTECT, related_name="+"
    )
    version = models.CharField(max_length=16)
    role = models.CharField(
        max_length=8,
        choices=[(role.value, role.value) for role in Role],
    )
    region = models.CharField(max_length=64)
    bucket_start = models.DateTimeField()
    bucket_s = models.PositiveIntegerField()
    requests = models.PositiveBigIntegerField(default=0)
    answered = models.PositiveBigIntegerField(default=0)
    refusals = models.PositiveBigIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)
    conversations = models.PositiveBigIntegerField(default=0)
    errors = models.JSONField(default=dict)
    ttft = models.JSONField(default=dict)
    output = models.JSONField(default=dict)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    tpot = models.JSONField(default=dict)
    judged = models.JSONField(default=dict)

    class Meta:
        db_table = "version_figures"
        ordering = ["-bucket_start", "model_id", "version", "role", "region"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "version", "role", "region", "bucket_start"],
                name="version_figures_bucket",
            ),
        ]
        indexes = [
            models.Index(
                fields=["model", "version", "role", "bucket_start"],
                name="version_figures_window",
            ),
        ]

    def __str__(self) -> str:
        return (
            f"{self.model_id}@{self.version} {self.role} {self.region} "
            f"{self.bucket_start:%Y-%m-%d %H:%M:%S}"
        )


class ReplicaSpan(models.Model):
    """A replica in one state from ``started_at`` until ``ended_at`` (null: still).

    The replicas' state history, for cost: GPU-hours per pool are the spans of the
    states that hold GPUs times ``gpus`` (``metering.domain.cost.pool_times``).
    Written by ``engine_nodes.models.Replica`` whenever a row is created, changes
    state or is deleted, so every path that moves a replica records it. Model,
    version and replica are plain values, not foreign keys: the history outlives
    the rows it describes. ``gone`` closes the last span and opens none.
    """

    replica_id = models.CharField(max_length=128)
    model = models.CharField(max_length=64)
    version = models.CharField(max_length=16)
    region = models.CharField(max_length=64)
    gpus = models.PositiveSmallIntegerField()
    state = models.CharField(max_length=16)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "replica_spans"
        ordering = ["-started_at", "replica_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["replica_id"],
                condition=Q(ended_at__isnull=True),
                name="replica_span_one_open",
            ),
            models.CheckConstraint(
                condition=Q(ended_at__isnull=True) | Q(ended_at__gte=F("started_at")),
                name="replica_span_ends_after_start",
            ),
        ]
        indexes = [
            models.Index(fields=["started_at"], name="replica_span_started"),
            models.Index(fields=["ended_at"], name="replica_span_ended"),
        ]

    def __str__(self) -> str:
        return (
            f"{self.replica_id} {self.state} from {self.started_at:%Y-%m-%d %H:%M:%S}"
        )
