"""Teams, their limits, their API keys, and the admin tokens of the control plane."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models import Q

from accounts.domain.entitlements import MAX_BUDGET_USD, MAX_HARD_FRACTION, TIERS
from accounts.domain.keys import SHA256_PATTERN
from accounts.domain.limits import MAX_TOKENS_PER_MINUTE
from config.names import SLUG_PATTERN, SLUG_RULE

slug_validator = RegexValidator(SLUG_PATTERN, f"Use {SLUG_RULE}.")
sha256_validator = RegexValidator(
    SHA256_PATTERN, "Must be 64 lowercase hex characters."
)


class Team(models.Model):
    """A product team calling the API (the seed's teams table); ``team`` is its slug."""

    team = models.CharField(
        primary_key=True, max_length=64, validators=[slug_validator]
    )
    name = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "teams"
        ordering = ["team"]

    def __str__(self) -> str:
        return self.team


class TeamLimit(models.Model):
    """A team's limits on one model: token bucket size, stream cap, guaranteed share."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="limits")
    model = models.ForeignKey(
        "models_registry.Model", on_delete=models.CASCADE, related_name="team_limits"
    )
    tokens_per_minute = models.PositiveBigIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(MAX_TOKENS_PER_MINUTE)]
    )
    max_concurrency = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    guaranteed_share = models.FloatField(
        default=0.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(1.0)],
        help_text="Fraction of every pool of this model reserved for the team (0-1).",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "team_limits"
        ordering = ["team_id", "model_id"]
        constraints = [
            models.UniqueConstraint(fields=["team", "model"], name="team_limit_unique"),
            models.CheckConstraint(
                condition=Q(tokens_per_minute__gte=1)
                & Q(tokens_per_minute__lte=MAX_TOKENS_PER_MINUTE),
                name="team_limit_tokens_positive",
            ),
            models.CheckConstraint(
                condition=Q(max_concurrency__gte=1),
                name="team_limit_concurrency_positive",
            ),
            models.CheckConstraint(
                condition=Q(guaranteed_share__gte=0.0) & Q(guaranteed_share__lte=1.0),
                name="team_limit_share_fraction",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.team_id} on {self.model_id}"


class TeamEntitlement(models.Model):
    """The priority tiers a team may ask for on one model (``x-priority``).

    Without a row the operator's default applies (``PLATFORM_DEFAULT_TIERS``). A
    request for another tier is refused with 403 ``tier_not_entitled`` before it
    is charged. ``tiers`` is a list of tier names in ``TIERS`` order, possibly
    empty (the team may use none: its traffic there is refused).
    """

    team = models.ForeignKey(
        Team, on_delete=models.CASCADE, related_name="entitlements"
    )
    model = models.ForeignKey(
        "models_registry.Model", on_delete=models.CASCADE, related_name="+"
    )
    tiers = models.JSONField(
        default=list, help_text=f"Tiers the team may use: any of {', '.join(TIERS)}."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "team_entitlements"
        ordering = ["team_id", "model_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["team", "model"], name="team_entitlement_unique"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.team_id} on {self.model_id}: {', '.join(self.tiers) or 'none'}"


class TeamBudget(models.Model):
    """A team's monthly budget in USD, on all its models (``model`` empty) or one.

    Spend is priced by the platform's cost model at a full pool's price
    (``routing.domain.budget``). At ``soft_fraction`` of the budget an alert
    fires; past ``hard_fraction`` new requests are refused with 429
    ``budget_exceeded`` until the next calendar month (UTC) or until the budget is
    raised. See docs/finance.md.
    """

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="budgets")
    model = models.ForeignKey(
        "models_registry.Model",
        on_delete=models.CASCADE,
        related_name="+",
        null=True,
        blank=True,
        help_text="Empty: the budget covers all the team's models.",
    )
    monthly_usd = models.DecimalField(
        max_digits=18,
        decimal_places=6,
        validators=[MinValueValidator(0.000001), MaxValueValidator(MAX_BUDGET_USD)],
    )
    soft_fraction = models.FloatField(
        default=0.8, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)]
    )
    hard_fraction = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(MAX_HARD_FRACTION)],
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "team_budgets"
        ordering = ["team_id", "model_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["team", "model"],
                name="team_budget_unique_model",
                condition=Q(model__isnull=False),
            ),
            models.UniqueConstraint(
                fields=["team"],
                name="team_budget_unique_team",
                condition=Q(model__isnull=True),
            ),
            models.CheckConstraint(
                condition=Q(monthly_usd__gt=0), name="team_budget_positive"
            ),
            models.CheckConstraint(
                condition=Q(soft_fraction__gt=0.0)
                & Q(soft_fraction__lte=1.0)
                & Q(soft_fraction__lte=models.F("hard_fraction")),
                name="team_budget_soft_fraction",
            ),
            models.CheckConstraint(
                condition=Q(hard_fraction__gt=0.0)
                & Q(hard_fraction__lte=MAX_HARD_FRACTION),
                name="team_budget_hard_fraction",
            ),
        ]

    def __str__(self) -> str:
        return (
            f"{self.team_id} on {self.model_id or 'all models'}: {self.monthly_usd} USD"
        )


class SecretRecordQuerySet(models.QuerySet):
    """Queries shared by API keys and admin tokens."""

    def active(self) -> SecretRecordQuerySet:
        """Return the records that have not been revoked."""
        return self.filter(revoked_at__isnull=True)


class SecretRecord(models.Model):
    """A bearer secret stored as its SHA-256 and a display prefix, never in clear."""

    key_hash = models.CharField(
        max_length=64, unique=True, editable=False, validators=[sha256_validator]
    )
    prefix = models.CharField(max_length=24, editable=False)
    name = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = SecretRecordQuerySet.as_manager()

    class Meta:
        abstract = True

    @property
    def is_active(self) -> bool:
        """True until the secret is revoked."""
        return self.revoked_at is None


class KeyPurpose(models.TextChoices):
    """Who holds an API key: a person of the team, or the platform for a batch job."""

    TEAM = "team", "team"
    BATCH = "batch", "batch"


class ApiKey(SecretRecord):
    """A team's key for the OpenAI-compatible API.

    ``purpose`` says who holds it: ``team``, a person of the team (issued through
    the API or the console, shown once); ``batch``, the platform itself, minted for
    one batch job whose runner sends the job's lines through the gateway with it
    (its secret is derived when needed, never stored). A batch key opens only the
    gateway's ``/v1/chat/completions`` and ``/v1/embeddings`` (what a batch runs):
    the control plane refuses it
    (``accounts.services.find_active_team_key``), and its requests are metered as
    batch work whatever their tier.
    """

    Purpose = KeyPurpose

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="api_keys")
    purpose = models.CharField(
        max_length=8,
        choices=KeyPurpose.choices,
        default=KeyPurpose.TEAM,
        editable=False,  # fixed when the key is made: by a person, or by a batch
    )

    class Meta:
        db_table = "api_keys"
        verbose_name = "API key"
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(key_hash__regex=SHA256_PATTERN), name="api_key_hash_hex"
            ),
            models.CheckConstraint(
                condition=Q(purpose__in=[p.value for p in KeyPurpose]),
                name="api_key_purpose_known",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.team_id})"


class AdminScope(models.TextChoices):
    """What an admin token opens: the whole control plane, or the reports only."""

    ADMIN = "admin", "admin: the whole control plane"
    REPORTS = "reports", "reports: usage and cost reports only (finance)"


class AdminToken(SecretRecord):
    """A bearer token for the control-plane REST API at /admin/.

    ``scope`` ``admin`` opens every endpoint; ``reports`` opens only
    ``/admin/reports/...``, for finance's tools (``accounts.auth``).
    """

    Scope = AdminScope

    scope = models.CharField(
        max_length=16,
        choices=AdminScope.choices,
        default=AdminScope.ADMIN,
        help_text="What the token opens; fixed when it is made.",
    )

    class Meta:
        db_table = "admin_tokens"
        verbose_name = "admin token"
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(key_hash__regex=SHA256_PATTERN), name="admin_token_hash_hex"
            ),
            models.CheckConstraint(
                condition=Q(scope__in=[s.value for s in AdminScope]),
                name="admin_token_scope_known",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name or 'admin token'})"


class RegionDemand(models.Model):
    """One region's recent demand on one team's limit, as its control loop last saw.

    Each region's ``control.region_limits`` tick upserts its rows every few
    seconds and every region reads them all, to share a team's limits across
    regions (``routing.domain.region_shares``). ``limit_key`` is the gateway's
    ``team:model``; the row with an empty key is the region's beat, so that a
    region with no demand still counts as live. A region drops its own rows of
    keys with no demand left; rows of a lost region simply age.
    """

    region = models.CharField(max_length=64)
    limit_key = models.CharField(max_length=300, blank=True)
    demand_tokens = models.PositiveBigIntegerField(default=0)
    window_s = models.FloatField()
    heard_at = models.DateTimeField()

    class Meta:
        db_table = "region_demand"
        ordering = ["region", "limit_key"]
        constraints = [
            models.UniqueConstraint(
                fields=["region", "limit_key"], name="region_demand_unique"
            )
        ]

    def __str__(self) -> str:
        return f"{self.region} {self.limit_key or '(beat)'}"
