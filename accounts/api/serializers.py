"""Bodies of the team endpoints, requests and responses (the schema is drawn from them).

Request fields are ``config.fields``': each takes only its JSON type, so the schema
says exactly what a 400 refuses.
"""

from __future__ import annotations

from rest_framework import serializers

from accounts.domain.entitlements import (
    MAX_BUDGET_USD,
    MAX_HARD_FRACTION,
    MIN_BUDGET_USD,
    TIERS,
)
from accounts.domain.limits import MAX_CONCURRENCY, MAX_TOKENS_PER_MINUTE
from config import fields


class TeamCreateSerializer(serializers.Serializer):
    """POST /admin/teams."""

    team = fields.SlugField()
    name = fields.TextField(max_length=200, required=False, allow_blank=True)


class KeyCreateSerializer(serializers.Serializer):
    """POST /admin/teams/{team}/keys."""

    name = fields.TextField(max_length=200, required=False, allow_blank=True)


class LimitSerializer(serializers.Serializer):
    """PUT /admin/teams/{team}/limits: the seed's body.

    Each bound is what its column holds or the domain's rule
    (``accounts.domain.limits``); a value past it is a 400 naming the field.
    """

    model = fields.SlugField()
    tokens_per_minute = fields.IntegerField(
        min_value=1, max_value=MAX_TOKENS_PER_MINUTE
    )
    max_concurrency = fields.IntegerField(min_value=1, max_value=MAX_CONCURRENCY)
    guaranteed_share = fields.NumberField(
        required=False, default=0.0, min_value=0.0, max_value=1.0
    )


class LimitOutSerializer(serializers.Serializer):
    """A team's limits on one model, as the API shows them."""

    team = serializers.CharField()
    model = serializers.CharField()
    tokens_per_minute = serializers.IntegerField()
    max_concurrency = serializers.IntegerField()
    guaranteed_share = serializers.FloatField()


class TeamSerializer(serializers.Serializer):
    """A team with its limits."""

    team = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    created_at = serializers.DateTimeField()
    limits = LimitOutSerializer(many=True)


class KeySerializer(serializers.Serializer):
    """A key's public record: never the secret, never its hash."""

    id = serializers.IntegerField()
    team = serializers.CharField()
    name = serializers.CharField(allow_blank=True)
    prefix = serializers.CharField()
    created_at = serializers.DateTimeField()
    last_used_at = serializers.DateTimeField(allow_null=True)
    revoked_at = serializers.DateTimeField(allow_null=True)


class KeyCreatedSerializer(KeySerializer):
    """A new key: its record and the secret, shown this once."""

    key = serializers.CharField()


class EntitlementSerializer(serializers.Serializer):
    """PUT /admin/teams/{team}/entitlements: the tiers a team may use on a model.

    An empty list lets the team use no tier there (every request refused 403).
    """

    model = fields.SlugField()
    tiers = serializers.ListField(
        child=serializers.ChoiceField(choices=list(TIERS)), max_length=len(TIERS) * 4
    )


class EntitlementOutSerializer(serializers.Serializer):
    """A team's tiers on one model, as the API shows them."""

    team = serializers.CharField()
    model = serializers.CharField()
    tiers = serializers.ListField(child=serializers.ChoiceField(choices=list(TIERS)))


class BudgetSerializer(serializers.Serializer):
    """PUT /admin/teams/{team}/budgets: a monthly budget in USD.

    ``model`` null or left out: the budget covers all the team's models.
    Fractions left out take the operator's defaults.
    """

    model = fields.SlugField(required=False, allow_null=True, default=None)
    monthly_usd = fields.NumberField(min_value=MIN_BUDGET_USD, max_value=MAX_BUDGET_USD)
    soft_fraction = fields.NumberField(required=False, greater_than=0.0, max_value=1.0)
    hard_fraction = fields.NumberField(
        required=False, greater_than=0.0, max_value=MAX_HARD_FRACTION
    )


class BudgetOutSerializer(serializers.Serializer):
    """A team's monthly budget, as the API shows it."""

    team = serializers.CharField()
    model = serializers.CharField(allow_null=True)
    monthly_usd = serializers.FloatField()
    soft_fraction = serializers.FloatField()
    hard_fraction = serializers.FloatField()
