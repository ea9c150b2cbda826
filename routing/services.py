"""Building the gateway's snapshot of the control plane (runs off the hot path)."""

from __future__ import annotations

import time

from accounts.models import ApiKey, Team, TeamLimit
from engine_nodes.models import Replica
from models_registry.models import Model, ModelVersion
from rollouts.domain.plan import Decision, Stage
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
        key_hash: KeyRecord(key_id=key_id, team=team_id)
        for key_id, key_hash, team_id in ApiKey.objects.active().values_list(
            "pk", "key_hash", "team_id"
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
        )
    shadows = {
        rollout.model_id: (labels.get(rollout.version_id), rollout.percent)
        for rollout in Rollout.objects.filter(
            decision=Decision.PENDING, stage=Stage.SHADOW
        )
    }
    models = {}
    for model in Model.objects.all():
        shadow_version, shadow_percent = shadows.get(model.model, (None, 0.0))
        models[model.model] = ModelRecord(
            model=model.model,
            live_version=_label(labels, model.live_version_id),
            canary_version=_label(labels, model.canary_version_id),
            canary_percent=model.canary_percent,
            shadow_version=shadow_version,
            shadow_percent=shadow_percent,
            policy=default_policy,
        )
    replicas = tuple(
        ReplicaRecord(
            replica_id=replica.replica_id,
            model=replica.model_id,
            version=labels.get(replica.version_id, ""),
            region=replica.region,
            url=replica.url,
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
    return ConfigSnapshot(
        built_at=time.time(),
        region=region,
        keys=keys,
        teams=teams,
        limits=limits,
        models=models,
        versions=versions,
        replicas=replicas,
    )


def _label(labels: dict[int, str], version_id: int | None) -> str | None:
    return labels.get(version_id) if version_id is not None else None
