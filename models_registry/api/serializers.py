"""Bodies of the model endpoints: shape checks only; rules live in services.

Request fields are ``config.fields``': each takes only its JSON type, so the schema
says exactly what a 400 refuses.
"""

from __future__ import annotations

from rest_framework import serializers

from config import fields
from models_registry.domain.gates import GateKind, GateState, RegionState
from models_registry.domain.identity import (
    MAX_GPUS_PER_REPLICA,
    Precision,
    VersionStatus,
)

# The largest embedding any model here makes (OpenAI's largest is 3,072), and the
# longest input any model takes.
MAX_EMBEDDING_DIMENSIONS = 65_536
MAX_INPUT_TOKENS = 2**31 - 1


class ModelCreateSerializer(serializers.Serializer):
    """POST /admin/models."""

    model = fields.SlugField()
    description = fields.TextField(max_length=300, required=False, allow_blank=True)
    kind = serializers.ChoiceField(choices=["chat", "embedding"], default="chat")
    # Bounded as the columns are (PostgreSQL integers): a larger value is a 400
    # naming the field, never the database's overflow.
    dimensions = serializers.IntegerField(
        min_value=1, max_value=MAX_EMBEDDING_DIMENSIONS, required=False
    )
    max_input_tokens = serializers.IntegerField(
        min_value=1, max_value=MAX_INPUT_TOKENS, required=False
    )


class VersionRegisterSerializer(serializers.Serializer):
    """POST /admin/models/{model}/versions: the seed's body, plus an optional label."""

    weights_uri = fields.StorageUriField()
    weights_hash = fields.HashField()
    tokenizer_hash = fields.HashField()
    # Required for a chat model; an embedding model renders no chat, so its
    # versions may leave it out (``register_version`` says which).
    chat_template = fields.TemplateField(required=False, default="")
    precision = serializers.ChoiceField(choices=[p.value for p in Precision])
    gpus_per_replica = fields.IntegerField(min_value=1, max_value=MAX_GPUS_PER_REPLICA)
    engine_config = fields.EngineConfigField(required=False, default=dict)
    version = fields.LabelField(required=False)
    eval_report_uri = fields.StorageUriField(required=False, allow_blank=True)


class GateRunSerializer(serializers.Serializer):
    """One gate of one attempt (``models_registry.services.gate_run_dict``)."""

    gate = serializers.ChoiceField(choices=[k.value for k in GateKind])
    attempt = serializers.IntegerField()
    state = serializers.ChoiceField(choices=[s.value for s in GateState])
    detail = serializers.CharField(allow_blank=True)
    progress = serializers.DictField(child=serializers.IntegerField())
    result = serializers.DictField()
    requested_by = serializers.CharField(allow_blank=True)
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)


class GateAttemptSerializer(serializers.Serializer):
    """A version's last gate attempt, gate by gate."""

    attempt = serializers.IntegerField()
    gates = GateRunSerializer(many=True)


class JudgeAgreementSerializer(serializers.Serializer):
    """A judge's agreement with people (``models_registry.domain.judge_agreement``)."""

    judge = serializers.CharField()
    labels = serializers.IntegerField(min_value=0)
    agreed = serializers.IntegerField(min_value=0)
    kappa = serializers.FloatField(allow_null=True)
    interval = serializers.ListField(
        child=serializers.FloatField(), min_length=2, max_length=2, allow_null=True
    )
    confidence = serializers.FloatField(allow_null=True)
    method = serializers.CharField()
    min_kappa = serializers.FloatField()
    min_labels = serializers.IntegerField(min_value=0)
    decides = serializers.BooleanField()
    can_gate = serializers.BooleanField()
    reason = serializers.CharField(allow_blank=True)


class GateHistorySerializer(serializers.Serializer):
    """GET /admin/models/{model}/versions/{version}/gates: every attempt."""

    model = serializers.CharField()
    version = serializers.CharField()
    status = serializers.ChoiceField(choices=[s.value for s in VersionStatus])
    status_reason = serializers.CharField(allow_blank=True)
    runs = GateRunSerializer(many=True)
    judge_agreement = JudgeAgreementSerializer(
        allow_null=True,
        help_text="The eval gate judge's agreement with human labels (Cohen's "
        "kappa with its interval, the floor, whether it may gate); null without "
        "a judge.",
    )


class RegionCopySerializer(serializers.Serializer):
    """A region's copy of the weights."""

    state = serializers.ChoiceField(choices=[s.value for s in RegionState])
    uri = serializers.CharField()
    detail = serializers.CharField(allow_blank=True)


class GateConfigSerializer(serializers.Serializer):
    """A model's gate settings (``models_registry.domain.gates.GateConfig``).

    Checked by ``parse_gate_config``; the fields here are for the schema.
    """

    eval_set_uri = serializers.CharField(required=False, allow_blank=True)
    judge_model = serializers.CharField(required=False, allow_blank=True)
    thresholds = serializers.DictField(child=serializers.FloatField(), required=False)
    min_kappa = serializers.FloatField(required=False)
    min_labels = serializers.IntegerField(required=False)
    load_test = serializers.DictField(child=serializers.FloatField(), required=False)
    # An embedding model's (models_registry.domain.embedding_eval).
    min_retrieval_accuracy = serializers.FloatField(required=False)
    embedding_normalized = serializers.BooleanField(required=False)


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
    load_test_prefix_hit_rate = serializers.FloatField(allow_null=True)
    status = serializers.ChoiceField(choices=[s.value for s in VersionStatus])
    status_reason = serializers.CharField(allow_blank=True)
    gates = GateAttemptSerializer(allow_null=True)
    regions = serializers.DictField(child=RegionCopySerializer())
    created_at = serializers.DateTimeField()


class PoolSerializer(serializers.Serializer):
    """A version's pool in one region."""

    version = serializers.CharField()
    region = serializers.CharField()
    min_replicas = serializers.IntegerField()
    max_replicas = serializers.IntegerField()
    # The version gates' staging pool: one replica, reached only by pinned requests.
    staging = serializers.BooleanField(required=False)
    # The traffic twin: the share of the pool's conversations recorded, no text
    # (routing.domain.traffic); 0 records none.
    record_traffic_share = serializers.FloatField(required=False)


class ModelSerializer(serializers.Serializer):
    """A model with its versions and pools (``models_registry.services.model_dict``)."""

    model = serializers.CharField()
    description = serializers.CharField(allow_blank=True)
    kind = serializers.CharField()
    dimensions = serializers.IntegerField(allow_null=True)
    max_input_tokens = serializers.IntegerField(allow_null=True)
    live_version = serializers.CharField(allow_null=True)
    canary_version = serializers.CharField(allow_null=True)
    canary_percent = serializers.FloatField()
    versions = VersionSerializer(many=True)
    pools = PoolSerializer(many=True)
