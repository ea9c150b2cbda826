"""Bodies of the alias and rollout endpoints, requests and responses.

Request fields are ``config.fields``': each takes only its JSON type, so the schema
says exactly what a 400 refuses.
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from config import fields
from models_registry.api.serializers import ModelSerializer
from rollouts.domain.plan import Decision, GuardAction, Stage
from rollouts.plans import Controls


class OverrideSerializer(serializers.Serializer):
    """An admin's override of the version gates: why (who is the admin token)."""

    reason = fields.TextField(max_length=2000)


class AliasSerializer(serializers.Serializer):
    """PUT /admin/models/{model}/alias."""

    version = fields.LabelField()
    # Needed only for a version whose gates have not passed; recorded.
    override = OverrideSerializer(required=False)


class RolloutSerializer(serializers.Serializer):
    """PUT /admin/models/{model}/rollout, in one of three forms.

    - ``{version, stage: shadow | canary, percent}``: a stage set by hand (the
      seed's body); the guards watch it and roll it back, but never advance it.
    - ``{version, plan: {...}}``: start the version on a plan that runs itself
      (``{}``: the model's plan, see ``rollout_plan``).
    - ``{action: pause | resume | approve | abort}``: act on the running rollout.
    """

    version = fields.LabelField(required=False)
    stage = serializers.ChoiceField(choices=[s.value for s in Stage], required=False)
    # Above 0 (``rollouts.domain.plan.stage_errors``): a 0% canary is no rollout.
    percent = fields.NumberField(greater_than=0.0, max_value=100.0, required=False)
    plan = serializers.DictField(required=False)
    action = serializers.ChoiceField(
        choices=[c.value for c in Controls], required=False
    )
    # Needed only for a version whose gates have not passed; recorded.
    override = OverrideSerializer(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "action" in attrs:
            extra = sorted(set(attrs) - {"action"})
            if extra:
                raise serializers.ValidationError(
                    {extra[0]: ["an action takes no other field"]}
                )
            return attrs
        if "version" not in attrs:
            raise serializers.ValidationError({"version": ["This field is required."]})
        if "plan" in attrs:
            for name in ("stage", "percent"):
                if name in attrs:
                    raise serializers.ValidationError(
                        {name: ["a plan sets its own stages; send one or the other"]}
                    )
            return attrs
        for name in ("stage", "percent"):
            if name not in attrs:
                raise serializers.ValidationError(
                    {name: ["This field is required (or send a plan)."]}
                )
        return attrs


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
    plan = serializers.DictField(allow_null=True)
    step = serializers.IntegerField()
    step_started_at = serializers.DateTimeField(allow_null=True)
    paused = serializers.BooleanField()
    approved_step = serializers.IntegerField(allow_null=True)
    reason = serializers.CharField(allow_blank=True)
    previous_version = serializers.CharField(allow_null=True)
    retire_after = serializers.DateTimeField(allow_null=True)
    retired_at = serializers.DateTimeField(allow_null=True)


class GuardEvaluationSerializer(serializers.Serializer):
    """One tick of the guards (``guard_metrics``)."""

    at = serializers.DateTimeField()
    step = serializers.IntegerField()
    stage = serializers.CharField()
    percent = serializers.FloatField()
    action = serializers.ChoiceField(choices=[a.value for a in GuardAction])
    reason = serializers.CharField()
    report = serializers.DictField()


class ModelDetailSerializer(ModelSerializer):
    """A model with its versions, pools and pending rollout."""

    rollout = RolloutOutSerializer(allow_null=True)


class RolloutStateSerializer(serializers.Serializer):
    """GET /admin/models/{model}/rollout: the pending rollout, the last 50, the
    model's plan, and the guards' latest evaluations of the newest rollout."""

    pending = RolloutOutSerializer(allow_null=True)
    history = RolloutOutSerializer(many=True)
    plan = serializers.DictField()
    evaluations = GuardEvaluationSerializer(many=True)


class RolloutPlanSerializer(serializers.Serializer):
    """A model's rollout plan (``rollouts.domain.plan.RolloutPlan``); checked by
    ``parse_plan``, the fields here are for the schema."""

    steps = serializers.ListField(child=serializers.DictField(), required=False)
    retention_s = serializers.FloatField(required=False)
    thresholds = serializers.DictField(required=False)
    max_step_s = serializers.FloatField(required=False)
    judge = serializers.DictField(
        required=False,
        allow_null=True,
        help_text="The live-answer judge: model, share, per_minute, min_win_rate.",
    )
