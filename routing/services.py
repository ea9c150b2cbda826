"""Building the gateway's snapshot of the control plane (runs off the hot path)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime

from django.conf import settings
from django.db.models import Q, Sum

from accounts.models import ApiKey, Team, TeamBudget, TeamEntitlement, TeamLimit
from engine_nodes.models import Replica
from metering.domain.cost import (
    TokenWeights,
    gpu_hour_usd_for,
    replica_tokens_per_s,
    usd_per_million_at_full,
)
from metering.models import Usage
from models_registry.models import Model, ModelVersion, Pool
from rollouts.domain.plan import Decision, JudgeSpec, PlanError, Stage, parse_plan
from rollouts.models import Rollout
from routing.domain.budget import NANO_PER_USD, Price, month_of
from routing.domain.snapshot import (
    BudgetRecord,
    ConfigSnapshot,
    EntitlementRecord,
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
    entitlements = {
        (row.team_id, row.model_id): EntitlementRecord(
            team=row.team_id, model=row.model_id, tiers=tuple(row.tiers)
        )
        for row in TeamEntitlement.objects.all()
    }
    versions: dict[tuple[str, str], VersionRecord] = {}
    labels: dict[int, str] = {}
    # Per (model, version): GPUs per replica and a replica's tokens per second,
    # what prices the version's tokens in every region.
    capacities: dict[tuple[str, str], tuple[int, float]] = {}
    region_pools = list(
        Pool.objects.filter(region=region).only(
            "model_id",
            "version_id",
            "min_replicas",
            "max_replicas",
            "desired_replicas",
            "record_traffic_share",
        )
    )
    # The share of each version's conversations its pool here records (the
    # traffic twin), by version id.
    traffic_shares = {
        pool.version_id: pool.record_traffic_share
        for pool in region_pools
        if pool.record_traffic_share > 0
    }
    for version in ModelVersion.objects.all():
        capacities[(version.model_id, version.version)] = replica_capacity(
            version.gpus_per_replica, version.load_test_tokens_per_s
        )
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
            usd_per_million=_usd_per_million(
                capacities[(version.model_id, version.version)], region
            ),
            traffic_share=traffic_shares.get(version.pk, 0.0),
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
        for pool in region_pools
        if pool.target_replicas > 0
    )
    built_at = time.time()
    return ConfigSnapshot(
        built_at=built_at,
        region=region,
        keys=keys,
        teams=teams,
        limits=limits,
        entitlements=entitlements,
        budgets=_budgets(
            region=region,
            month=month_of(built_at),
            capacities=capacities,
            embedding_models=frozenset(
                name for name, record in models.items() if record.is_embedding
            ),
        ),
        models=models,
        versions=versions,
        replicas=replicas,
        pools=pools,
    )


def _label(labels: dict[int, str], version_id: int | None) -> str | None:
    return labels.get(version_id) if version_id is not None else None


def _usd_per_million(capacity: tuple[int, float], region: str) -> float:
    """Return what a million weighted tokens of a version cost in ``region`` at a
    full pool (the usage report's price per token)."""
    gpus, tokens_per_s = capacity
    return usd_per_million_at_full(
        gpus_per_replica=gpus,
        gpu_hour_usd=gpu_hour_usd_for(
            region,
            default=settings.PLATFORM_GPU_HOUR_USD,
            by_region=settings.PLATFORM_GPU_HOUR_USD_BY_REGION,
        ),
        tokens_per_s=tokens_per_s,
    )


def month_budgets(
    *, region: str, month: str, team_id: str | None = None
) -> dict[tuple[str, str], BudgetRecord]:
    """Return the budgets (of one team, or all) with their spend in ``month`` as
    the gateway's snapshot holds them (the console shows them so)."""
    capacities = {
        (model, version): replica_capacity(gpus, measured)
        for model, version, gpus, measured in ModelVersion.objects.values_list(
            "model_id", "version", "gpus_per_replica", "load_test_tokens_per_s"
        )
    }
    embedding = frozenset(
        Model.objects.filter(kind="embedding").values_list("pk", flat=True)
    )
    return _budgets(
        region=region,
        month=month,
        capacities=capacities,
        embedding_models=embedding,
        team_id=team_id,
    )


def replica_capacity(gpus: int, measured: float | None) -> tuple[int, float]:
    """Return a version's GPUs per replica and a replica's tokens per second (the
    load test's, else ``PLATFORM_ASSUMED_TOKENS_PER_S``): what prices it."""
    tokens_per_s, _assumed = replica_tokens_per_s(
        measured, assumed=settings.PLATFORM_ASSUMED_TOKENS_PER_S
    )
    return gpus, tokens_per_s


def _budgets(
    *,
    region: str,
    month: str,
    capacities: Mapping[tuple[str, str], tuple[int, float]],
    embedding_models: frozenset[str],
    team_id: str | None = None,
) -> dict[tuple[str, str], BudgetRecord]:
    """Return every budget with its spend this month, from the flushed usage rows.

    One grouped query over the month's rows of the teams with a budget; each row
    priced at its own region's price, as the gateway prices a request
    (``routing.domain.budget.Price``), so the two add up.
    """
    budgets = TeamBudget.objects.all()
    if team_id is not None:
        budgets = budgets.filter(team_id=team_id)
    rows = list(budgets)
    if not rows:
        return {}
    weights = TokenWeights(**settings.PLATFORM_COST_WEIGHTS)
    start = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)
    spent: dict[tuple[str, str, bool], int] = {}  # (team, model, here) -> nano
    usage = (
        Usage.objects.filter(
            team_id__in={row.team_id for row in rows}, minute__gte=start
        )
        .values("team_id", "model_id", "version__version", "region")
        .annotate(
            prompt=Sum("prompt_tokens"),
            cached=Sum("cached_tokens"),
            output=Sum("output_tokens"),
        )
    )
    for item in usage:
        capacity = capacities.get((item["model_id"], item["version__version"]))
        if capacity is None:
            continue
        price = Price(
            usd_per_million=_usd_per_million(capacity, item["region"]),
            weights=weights,
            input_priced=item["model_id"] in embedding_models,
        )
        cost = price.cost_nano(
            prompt_tokens=item["prompt"] or 0,
            cached_tokens=item["cached"] or 0,
            output_tokens=item["output"] or 0,
        )
        key = (item["team_id"], item["model_id"], item["region"] == region)
        spent[key] = spent.get(key, 0) + cost

    def spend(team: str, model: str | None, *, here: bool) -> float:
        return (
            sum(
                nano
                for (t, m, h), nano in spent.items()
                if t == team and h == here and model in (None, m)
            )
            / NANO_PER_USD
        )

    return {
        (row.team_id, row.model_id or ""): BudgetRecord(
            team=row.team_id,
            model=row.model_id or "",
            monthly_usd=float(row.monthly_usd),
            soft_fraction=row.soft_fraction,
            hard_fraction=row.hard_fraction,
            month=month,
            spent_here_usd=spend(row.team_id, row.model_id, here=True),
            spent_elsewhere_usd=spend(row.team_id, row.model_id, here=False),
        )
        for row in rows
    }


def _judge_of(rollout: Rollout) -> JudgeSpec | None:
    """The live-answer judge of a pending rollout's plan (None: none, a stage set
    by hand, or a stored plan the code no longer reads)."""
    if rollout.plan is None:
        return None
    try:
        return parse_plan(rollout.plan).judge
    except PlanError:
        return None
