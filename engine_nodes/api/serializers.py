"""Response shapes of the replica endpoints (for the schema); rules live in services."""

from __future__ import annotations

from rest_framework import serializers


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
