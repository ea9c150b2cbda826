"""Request bodies of the model endpoints: shape checks only; rules live in services."""

from __future__ import annotations

from rest_framework import serializers

from models_registry.domain.identity import Precision


class ModelCreateSerializer(serializers.Serializer):
    """POST /admin/models."""

    model = serializers.CharField(max_length=64)
    description = serializers.CharField(
        max_length=300, required=False, allow_blank=True
    )


class VersionRegisterSerializer(serializers.Serializer):
    """POST /admin/models/{model}/versions: the seed's body, plus an optional label."""

    weights_uri = serializers.CharField(max_length=1024)
    weights_hash = serializers.CharField(max_length=64)
    tokenizer_hash = serializers.CharField(max_length=64)
    chat_template = serializers.CharField(trim_whitespace=False)
    precision = serializers.ChoiceField(choices=[p.value for p in Precision])
    gpus_per_replica = serializers.IntegerField()
    engine_config = serializers.JSONField(required=False, default=dict)
    version = serializers.CharField(max_length=16, required=False)
    eval_report_uri = serializers.CharField(
        max_length=1024, required=False, allow_blank=True
    )


class VersionSerializer(serializers.Serializer):
    """A registered version as returned by the API (for the schema)."""

    model = serializers.CharField()
    version = serializers.CharField()
    weights_uri = serializers.CharField()
    weights_hash = serializers.CharField()
    tokenizer_hash = serializers.CharField()
    chat_template_hash = serializers.CharField()
    precision = serializers.CharField()
    gpus_per_replica = serializers.IntegerField()
    engine_config = serializers.JSONField()
    eval_report_uri = serializers.CharField(allow_null=True)
    load_test_tokens_per_s = serializers.FloatField(allow_null=True)
    load_test_tokens_in_flight = serializers.IntegerField(allow_null=True)
    status = serializers.CharField()
    created_at = serializers.DateTimeField()
