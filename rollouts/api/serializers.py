"""Bodies of the alias and rollout endpoints, requests and responses.

Request fields are ``config.fields``': each takes only its JSON type, so the schema
says exactly what a 400 refuses.
"""

from __future__ import annotations

from rest_framework import serializers

from config import fields
from models_registry.api.serializers import ModelSerializer
from rollouts.domain.plan import Decision, Stage


class OverrideSerializer(serializers.Serializer):
    """An admin's override of the version gates: why (who is the admin token)."""

    reason = fields.TextField(max_length=2000)


class AliasSerializer(serializers.Serializer):
    """PUT /admin/models/{model}/alias."""

    version = fields.LabelField()
    # Needed only for a version whose gates have not passed; recorded.
    override = OverrideSerializer(required=False)


class RolloutSerializer(serializers.Serializer):
    """PUT /admin/models/{model}/rollout: { version, stage: shadow | canary, percent }."""

    version = fields.LabelField()
    stage = serializers.ChoiceField(choices=[s.value for s in Stage])
    # Above 0 (``rollouts.domain.plan.stage_errors``): a 0% canary is no rollout.
    percent = fields.NumberField(greater_than=0.0, max_value=100.0)
    # Needed only for a version whose gates have not passed; recorded.
    override = OverrideSerializer(required=False)


class RolloutOutSerializer(serializers.Serializer):
    """A rollout row as the API shows it (``rollouts.services.rollout_dict``)."""

    id = serializers.IntegerField()
    model = serializers.CharField()
    version = serializers.CharField()
    stage = serializers.ChoiceField(choices=[s.value for s in Stage])
    percent = serializers.FloatField()
    started_at = serializers.DateTimeField()
    guard_metrics = serializers.DictField()
    decision = serializers.ChoiceField(choices=[d.value for d in Decision])
    decided_at = serializers.DateTimeField(allow_null=True)


class ModelDetailSerializer(ModelSerializer):
    """A model with its versions, pools and pending rollout."""

    rollout = RolloutOutSerializer(allow_null=True)


class RolloutStateSerializer(serializers.Serializer):
    """GET /admin/models/{model}/rollout: the pending rollout and the last 50."""

    pending = RolloutOutSerializer(allow_null=True)
    history = RolloutOutSerializer(many=True)
