"""Bodies of the pool endpoints: the autoscaling settings (request and response) and
the pool state (response); rules live in services and the registry's domain.

Request fields are ``config.fields``': each takes only its JSON type and its own
bounds, so the schema says what a 400 refuses field by field. Rules between fields
(min above max, the scale-down threshold not below the target, overlapping
schedule rows that disagree) are ``models_registry.domain.scaling``'s, refused by
the service with a 400 naming the field.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from config import fields
from models_registry.domain.autoscaler import Reason
from models_registry.domain.scaling import (
    MAX_PANIC_FACTOR,
    MAX_REPLICAS,
    MAX_SCALE_DOWN_INTERVAL_S,
    MAX_SCHEDULE_RULES,
    MAX_WINDOW_S,
    MINUTES_PER_DAY,
)

# Why a pool's size is what it is: one choice set, one schema name
# (``ENUM_NAME_OVERRIDES`` in the settings).
REASONS = [r.value for r in Reason]


class ScheduleRuleSerializer(serializers.Serializer):
    """One scheduled floor: at least ``min_replicas`` on ``weekdays`` (0 Monday to
    6 Sunday) from ``start_minute`` to ``end_minute`` (UTC minutes of the day, the
    end excluded; 08:30-10:00 is 510-600)."""

    weekdays = serializers.ListField(
        child=fields.IntegerField(min_value=0, max_value=6),
        min_length=1,
        max_length=7,
    )
    start_minute = fields.IntegerField(min_value=0, max_value=MINUTES_PER_DAY - 1)
    end_minute = fields.IntegerField(min_value=1, max_value=MINUTES_PER_DAY)
    min_replicas = fields.IntegerField(min_value=0, max_value=MAX_REPLICAS)


class AutoscalingSerializer(serializers.Serializer):
    """PUT /admin/pools/{model}/{version}/{region}/autoscaling.

    Every field is optional: those not sent keep their values. ``schedule``, when
    sent, replaces the pool's schedule rows (``[]`` removes them).
    """

    min_replicas = fields.IntegerField(
        required=False, min_value=0, max_value=MAX_REPLICAS
    )
    max_replicas = fields.IntegerField(
        required=False, min_value=1, max_value=MAX_REPLICAS
    )
    warm_floor = fields.IntegerField(
        required=False, min_value=0, max_value=MAX_REPLICAS
    )
    target_utilisation = fields.NumberField(
        required=False, greater_than=0.0, less_than=1.0
    )
    scale_down_utilisation = fields.NumberField(
        required=False, greater_than=0.0, less_than=1.0
    )
    stable_window_s = fields.NumberField(
        required=False, greater_than=0.0, max_value=MAX_WINDOW_S
    )
    panic_window_s = fields.NumberField(
        required=False, greater_than=0.0, max_value=MAX_WINDOW_S
    )
    panic_factor = fields.NumberField(
        required=False, greater_than=1.0, max_value=MAX_PANIC_FACTOR
    )
    scale_down_interval_s = fields.NumberField(
        required=False, min_value=0.0, max_value=MAX_SCALE_DOWN_INTERVAL_S
    )
    warm_nodes_min = fields.IntegerField(
        required=False, min_value=0, max_value=MAX_REPLICAS
    )
    warm_nodes_max = fields.IntegerField(
        required=False, min_value=0, max_value=MAX_REPLICAS
    )
    warm_horizon_s = fields.NumberField(
        required=False, greater_than=0.0, max_value=MAX_WINDOW_S
    )
    schedule = serializers.ListField(
        child=ScheduleRuleSerializer(), required=False, max_length=MAX_SCHEDULE_RULES
    )


class AutoscalingOutSerializer(serializers.Serializer):
    """A pool's autoscaling settings and schedule, and the size the agents aim at."""

    model = serializers.CharField()
    version = serializers.CharField()
    region = serializers.CharField()
    min_replicas = serializers.IntegerField()
    max_replicas = serializers.IntegerField()
    warm_floor = serializers.IntegerField()
    target_utilisation = serializers.FloatField()
    scale_down_utilisation = serializers.FloatField()
    stable_window_s = serializers.FloatField()
    panic_window_s = serializers.FloatField()
    panic_factor = serializers.FloatField()
    scale_down_interval_s = serializers.FloatField()
    warm_nodes_min = serializers.IntegerField()
    warm_nodes_max = serializers.IntegerField()
    warm_horizon_s = serializers.FloatField()
    desired_replicas = serializers.IntegerField()
    schedule = ScheduleRuleSerializer(many=True)


class DecisionSerializer(serializers.Serializer):
    """One change of a pool's desired size, and the signals it was made on."""

    decided_at = serializers.DateTimeField()
    from_replicas = serializers.IntegerField()
    to_replicas = serializers.IntegerField()
    reason = serializers.ChoiceField(choices=REASONS)
    utilisation = serializers.FloatField(allow_null=True)
    is_panicking = serializers.BooleanField()
    is_capacity_exhausted = serializers.BooleanField()
    capacity_is_assumed = serializers.BooleanField()
    signals = serializers.DictField(child=serializers.FloatField())


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


# models_registry's PoolSerializer is "Pool" too: one name for two shapes would
# leave one of them out of the schema.
@extend_schema_serializer(component_name="PoolStateEntry")
class PoolSerializer(serializers.Serializer):
    """One pool in the pool state: its capacity, its live figures, and what the
    autoscaler sees and did.

    The live figures are the gateways' for this pool (version and region), written
    for every request whether or not a rollout runs, over the last five minutes:
    ``requests``, TTFT and time-per-output-token quantiles (ms), ``prefix_hit_rate``
    (cached over prompt tokens) and ``usd_per_million_tokens`` (the GPUs the pool
    holds, at its region's price, over the prompt and output tokens it served);
    null while the pool served nothing. ``router_tokens_in_flight`` (prompt plus
    remaining output of the requests the gateways have open on its replicas),
    ``router_queue_depth`` (requests waiting in their admission queues) and
    ``router_utilisation`` (those tokens over ``capacity_tokens_in_flight``) are
    the gateways' live-load shares now: null for a pool of another region than
    the answering control plane's, or while its Redis does not answer.
    ``utilisation`` and the ``autoscaler_*`` figures are the last tick's
    (``observed_at``; null before the first); ``warnings`` say when capacity is
    exhausted or assumed. ``kind`` is what the pool serves: an ``embedding`` pool
    is sized on input tokens/s, ``replica_tokens_per_s`` a replica (measured, else
    the default), ``capacity_tokens_per_s`` its serving replicas', and
    ``admitted_tokens_per_s`` what the gateways admitted at the last tick (all
    three null for a ``chat`` pool).
    """

    version = serializers.CharField()
    region = serializers.CharField()
    kind = serializers.ChoiceField(choices=["chat", "embedding"])
    min_replicas = serializers.IntegerField()
    max_replicas = serializers.IntegerField()
    serving_replicas = serializers.IntegerField()
    capacity_tokens_in_flight = serializers.IntegerField()
    capacity_is_measured = serializers.BooleanField()
    requests = serializers.IntegerField()
    ttft_p95_ms = serializers.FloatField(allow_null=True)
    ttft_p99_ms = serializers.FloatField(allow_null=True)
    tpot_p50_ms = serializers.FloatField(allow_null=True)
    tpot_p95_ms = serializers.FloatField(allow_null=True)
    prefix_hit_rate = serializers.FloatField(allow_null=True)
    usd_per_million_tokens = serializers.FloatField(allow_null=True)
    router_tokens_in_flight = serializers.IntegerField(allow_null=True)
    router_queue_depth = serializers.IntegerField(allow_null=True)
    router_utilisation = serializers.FloatField(allow_null=True)
    desired_replicas = serializers.IntegerField()
    starting_replicas = serializers.IntegerField()
    replica_tokens_in_flight = serializers.IntegerField()
    replica_tokens_per_s = serializers.FloatField(allow_null=True)
    capacity_tokens_per_s = serializers.FloatField(allow_null=True)
    admitted_tokens_per_s = serializers.FloatField(allow_null=True)
    capacity_is_assumed = serializers.BooleanField()
    utilisation = serializers.FloatField(allow_null=True)
    stable_utilisation = serializers.FloatField(allow_null=True)
    autoscaler_tokens_in_flight = serializers.IntegerField(allow_null=True)
    autoscaler_queued_tokens = serializers.IntegerField(allow_null=True)
    autoscaler_queue_depth = serializers.IntegerField(allow_null=True)
    is_capacity_exhausted = serializers.BooleanField()
    is_panicking = serializers.BooleanField()
    last_reason = serializers.ChoiceField(choices=REASONS, allow_null=True)
    warm_nodes = serializers.IntegerField()
    observed_at = serializers.DateTimeField(allow_null=True)
    warnings = serializers.ListField(child=serializers.CharField())
    autoscaling = AutoscalingOutSerializer()
    decisions = DecisionSerializer(many=True)


class PoolStateSerializer(serializers.Serializer):
    """GET /admin/pools/{model}/state: the seed's fields plus per-pool capacity,
    live figures and autoscaling.

    ``queue_depth`` and ``tokens_in_flight`` sum the serving replicas' heartbeats;
    the routers' figures are each pool's ``router_*``. ``prefix_hit_rate`` is the
    pools' live figures summed over the model's pools (``region``'s with
    ``?region=``): cached over prompt tokens in the last five minutes.
    """

    model = serializers.CharField()
    region = serializers.CharField(allow_null=True)
    replicas = ReplicaStateSerializer(many=True)
    queue_depth = serializers.IntegerField()
    tokens_in_flight = serializers.IntegerField()
    prefix_hit_rate = serializers.FloatField(allow_null=True)
    pools = PoolSerializer(many=True)


class PoolTrafficSerializer(serializers.Serializer):
    """PUT /admin/pools/{model}/{version}/{region}/traffic: the share of the pool's
    conversations the gateways record for the traffic twin (0: none)."""

    record_traffic_share = fields.NumberField(min_value=0.0, max_value=1.0)


class PoolTrafficOutSerializer(serializers.Serializer):
    """A pool's traffic-twin setting."""

    model = serializers.CharField()
    version = serializers.CharField()
    region = serializers.CharField()
    record_traffic_share = serializers.FloatField()
