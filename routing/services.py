"""Building the gateway's snapshot of the control plane (runs off the hot path)."""

from __future__ import annotations

import time

from django.db.models import Q

from accounts.models import ApiKey, Team, TeamLimit
from engine_nodes.models import Replica
from models_registry.models import Model, ModelVersion, Pool
from rollouts.domain.plan import Decision, JudgeSpec, PlanError, Stage, parse_plan
from rollouts.models import Rollout
from routing.domain.snapshot import (
    ConfigSnapshot,
    KeyRecord,
    LimitRecord,
    ModelRecord,
    ReplicaRecord,
    VersionRecord,
)

DEFAULT_MAX_MODEL_LEN = 8192


def build_snapshot(*, region: str, default_policy: str) -> ConfigSnapshot:
    """Read everything the gateway needs in a handful of queries; return it frozen.

    Keys are indexed by their hash; only active keys are included, so a revoked
    key stops working at the next refresh. Shadow routing comes from the model's
    pending rollout when it is at the shadow stage.
    """
    keys = {
        key_hash: KeyRecord(
            key_id=key_id, team=team_id, batch=purpose == ApiKey.Purpose.BATCH
        )
        for key_id, key_hash, team_id, purpose in ApiKey.objects.active().values_list(
            "pk", "key_hash", "team_id", "purpose"
        )
    }
    teams = frozenset(Team.objects.values_list("team", flat=True))
    limits = {
        (row.team_id, row.model_id): LimitRecord(
            team=row.team_id,
            model=row.model_id,
            tokens_per_minute=row.tokens_per_minute,
            max_concurrency=row.max_concurrency,
            guaranteed_share=row.guaranteed_share,
        )
        for row in TeamLimit.objects.all()
    }
    versions: dict[tuple[str, str], VersionRecord] = {}
    labels: dict[int, str] = {}
    for version in ModelVersion.objects.all():
        labels[version.pk] = version.version
        config = (
            version.engine_config if isinstance(version.engine_config, dict) else {}
        )
        versions[(version.model_id, version.version)] = VersionRecord(
            model=version.model_id,
            version=version.version,
            status=version.status,
            max_model_len=int(config.get("max_model_len") or DEFAULT_MAX_MODEL_LEN),
            load_test_tokens_in_flight=version.load_test_tokens_in_flight,
            weights_uri=version.weights_uri,
            tokenizer_hash=version.tokenizer_hash,
            chat_template=version.chat_template,
            priority_scheduling=config.get("scheduling_policy") == "priority",
            tool_call_parser=str(config.get("tool_call_parser") or ""),
        )
    # One query for what the rollouts say: the pending ones (the memory of
    # conversations begins with them; a begun shadow step copies requests), and
    # the version a promotion replaced, loaded until its retention ends (its
    # conversations may finish there: routing.domain.sticky).
    shadows: dict[str, tuple[str | None, float]] = {}
    judges: dict[str, JudgeSpec] = {}
    retained: dict[str, str | None] = {}
    pending: set[str] = set()
    rows = Rollout.objects.filter(
        Q(decision=Decision.PENDING)
        | Q(
            decision=Decision.PROMOTED,
            retired_at=None,
            previous_version__isnull=False,
        )
    ).order_by("decided_at", "pk")
    for rollout in rows:
        if rollout.decision == Decision.PROMOTED:
            retained[rollout.model_id] = labels.get(rollout.previous_version_id or 0)
            continue
        pending.add(rollout.model_id)
        if (judge := _judge_of(rollout)) is not None:
            judges[rollout.model_id] = judge
        # A plan's step takes traffic once its replicas serve (step_started_at).
        if rollout.stage == Stage.SHADOW and rollout.step_started_at is not None:
            shadows[rollout.model_id] = (
                labels.get(rollout.version_id),
                rollout.percent,
            )
    models = {}
    for model in Model.objects.all():
        shadow_version, shadow_percent = shadows.get(model.model, (None, 0.0))
        judge = judges.get(model.model)
        models[model.model] = ModelRecord(
            model=model.model,
            live_version=_label(labels, model.live_version_id),
            canary_version=_label(labels, model.canary_version_id),
            canary_percent=model.canary_percent,
            shadow_version=shadow_version,
            shadow_percent=shadow_percent,
            policy=default_policy,
            rollout_pending=model.model in pending,
            kind=model.kind,
            dimensions=model.dimensions or 0,
            max_input_tokens=model.max_input_tokens or 0,
            judge_model=judge.model if judge is not None else "",
            judge_share=judge.share if judge is not None else 0.0,
            judge_per_minute=judge.per_minute if judge is not None else 0,
            retained_version=(
                retained.get(model.model)
                if retained.get(model.model) != _label(labels, model.live_version_id)
                else None
            ),
        )
    replicas = tuple(
        ReplicaRecord(
            replica_id=replica.replica_id,
            model=replica.model_id,
            version=labels.get(replica.version_id, ""),
            region=replica.region,
            url=replica.url,
            kv_events_url=replica.kv_events_url,
            state=replica.state,
            queue_depth=replica.queue_depth,
            tokens_in_flight=replica.tokens_in_flight,
            kv_cache_usage_perc=replica.kv_cache_usage_perc,
            last_heartbeat_at=(
                replica.last_heartbeat.timestamp() if replica.last_heartbeat else None
            ),
        )
        for replica in Replica.objects.live().filter(region=region)
    )
    pools = frozenset(
        (pool.model_id, labels.get(pool.version_id, ""))
        for pool in Pool.objects.filter(region=region).only(
            "model_id", "version_id", "min_replicas", "max_replicas", "desired_replicas"
        )
        if pool.target_replicas > 0
    )
    return ConfigSnapshot(
        built_at=time.time(),
        region=region,
        keys=keys,
        teams=teams,
        limits=limits,
        models=models,
        versions=versions,
        replicas=replicas,
        pools=pools,
    )


def _label(labels: dict[int, str], version_id: int | None) -> str | None:
    return labels.get(version_id) if version_id is not None else None


def _judge_of(rollout: Rollout) -> JudgeSpec | None:
    """The live-answer judge of a pending rollout's plan (None: none, a stage set
    by hand, or a stored plan the code no longer reads)."""
    if rollout.plan is None:
        return None
    try:
        return parse_plan(rollout.plan).judge
    except PlanError:
        return None
