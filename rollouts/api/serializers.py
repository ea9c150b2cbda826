"""Request bodies of the alias and rollout endpoints."""

from __future__ import annotations

from rest_framework import serializers

from rollouts.domain.plan import Stage


class AliasSerializer(serializers.Serializer):
    """PUT /admin/models/{model}/alias."""

    version = serializers.CharField(max_length=16)


class RolloutSerializer(serializers.Serializer):
    """PUT /admin/models/{model}/rollout: { version, stage: shadow | canary, percent }."""

    version = serializers.CharField(max_length=16)
    stage = serializers.ChoiceField(choices=[s.value for s in Stage])
    percent = serializers.FloatField(min_value=0.0, max_value=100.0)
