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


class AliasSerializer(serializers.Serializer):
    """PUT /admin/models/{model}/alias."""

    version = serializers.CharField(max_length=16)


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


class ReplicaStateSerializer(serializers.Serializer):
    """One replica in the pool state."""

    replica_id = serializers.CharField()
    version = serializers.CharField()
    region = serializers.CharField()
    node = serializers.CharField()
    state = serializers.CharField()
    is_silent = serializers.BooleanField()
    queue_depth = serializers.IntegerField()
    tokens_in_flight = serializers.IntegerField()
    kv_cache_usage_perc = serializers.FloatField()
    last_heartbeat = serializers.DateTimeField(allow_null=True)


class PoolStateSerializer(serializers.Serializer):
    """GET /admin/pools/{model}/state: the seed's fields plus per-pool capacity."""

    model = serializers.CharField()
    region = serializers.CharField(allow_null=True)
    replicas = ReplicaStateSerializer(many=True)
    queue_depth = serializers.IntegerField()
    tokens_in_flight = serializers.IntegerField()
    prefix_hit_rate = serializers.FloatField(allow_null=True)
    pools = serializers.ListField(child=serializers.DictField())
