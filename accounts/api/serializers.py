"""Request bodies of the team endpoints."""

from __future__ import annotations

from rest_framework import serializers


class TeamCreateSerializer(serializers.Serializer):
    """POST /admin/teams."""

    team = serializers.CharField(max_length=64)
    name = serializers.CharField(max_length=200, required=False, allow_blank=True)


class KeyCreateSerializer(serializers.Serializer):
    """POST /admin/teams/{team}/keys."""

    name = serializers.CharField(max_length=200, required=False, allow_blank=True)


class LimitSerializer(serializers.Serializer):
    """PUT /admin/teams/{team}/limits: the seed's body."""

    model = serializers.CharField(max_length=64)
    tokens_per_minute = serializers.IntegerField()
    max_concurrency = serializers.IntegerField()
    guaranteed_share = serializers.FloatField(required=False, default=0.0)
