"""Bodies of the model endpoints: shape checks only; rules live in services.

Request fields are ``config.fields``': each takes only its JSON type, so the schema
says exactly what a 400 refuses.
"""

from __future__ import annotations

from rest_framework import serializers

from config import fields
from models_registry.domain.identity import MAX_GPUS_PER_REPLICA, Precision


class ModelCreateSerializer(serializers.Serializer):
    """POST /admin/models."""

    model = fields.SlugField()
    description = fields.TextField(max_length=300, required=False, allow_blank=True)


class VersionRegisterSerializer(serializers.Serializer):
    """POST /admin/models/{model}/versions: the seed's body, plus an optional label."""

    weights_uri = fields.StorageUriField()
    weights_hash = fields.HashField()
    tokenizer_hash = fields.HashField()
    chat_template = fields.TemplateField()
    precision = serializers.ChoiceField(choices=[p.value for p in Precision])
    gpus_per_replica = fields.IntegerField(min_value=1, max_value=MAX_GPUS_PER_REPLICA)
    engine_config = fields.EngineConfigField(required=False, default=dict)
    version = fields.LabelField(required=False)
    eval_report_uri = fields.StorageUriField(required=False, allow_blank=True)


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


class PoolSerializer(serializers.Serializer):
    """A version's pool in one region."""

    version = serializers.CharField()
    region = serializers.CharField()
    min_replicas = serializers.IntegerField()
    max_replicas = serializers.IntegerField()


class ModelSerializer(serializers.Serializer):
    """A model with its versions and pools (``models_registry.services.model_dict``)."""

    model = serializers.CharField()
    description = serializers.CharField(allow_blank=True)
    live_version = serializers.CharField(allow_null=True)
    canary_version = serializers.CharField(allow_null=True)
    canary_percent = serializers.FloatField()
    versions = VersionSerializer(many=True)
    pools = PoolSerializer(many=True)
