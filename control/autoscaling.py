"""The autoscaler, live: each tick gathers a region's pool signals, calls the policy,
and writes the desired size and a row saying why.

Public surface: ``autoscale_region``, ``pool_signals``, ``scaling_settings``,
``read_load_shares``, ``region_redis``, ``pool_state``, ``pool_figures``,
``pool_kind``, ``replica_capacity``, ``replica_tokens_per_s``,
``pool_live_figures``, ``autoscaling_dict``,
``decision_dict``, ``get_pool``, ``set_pool_autoscaling``, ``prune_decisions``, and
the JSON they hand to views and the console: ``PoolStateOut`` (with ``PoolOut``,
``ReplicaStateOut``), ``AutoscalingOut`` (``ScheduleRuleOut``), ``DecisionOut``.

The policy is ``models_registry.domain.autoscaler.decide`` (the same function the fleet
simulator runs in virtual time). Per pool of the region, each tick (the Celery beat
task ``control.autoscale_pools``, every ``PLATFORM_AUTOSCALE_INTERVAL_S``):

1. **Signals.** Serving and starting replicas from the ``Replica`` rows (serving:
   state serving and heard from within the missed-beat window; starting: every
   other replica the node agents count, i.e. starting, loading, stalled or silent,
   but not draining or gone). Tokens in flight, queued tokens and queued requests
   summed over the region's gateway processes from their live-load shares in
   Redis (``engine_nodes.domain.load_shares``); without Redis, or while it does
   not answer, tokens in flight are the serving replicas' heartbeat figures and
   the admission queue is not seen. The replicas' own engine queues (from their
   beats) are added to the queue depth either way. Capacity per replica is the
   version's ``load_test_tokens_in_flight``, else
   ``PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT``, flagged as assumed. An
   embedding pool (its model's ``kind``) is sized on input tokens/s instead: each
   gateway process's cumulative count of tokens admitted into the pool (its share's
   ``a|model|version``) goes to the policy, which takes the rate since the last
   tick, against the version's ``load_test_tokens_per_s`` (input tokens/s at its
   latency target), else ``PLATFORM_DEFAULT_EMBEDDING_REPLICA_TOKENS_PER_S``,
   flagged as assumed; without Redis its tokens in flight stand in, at the
   measured ratio of the two load-test figures. Free GPUs are
   ``engine_nodes.services.free_gpus`` less the GPUs of replicas other pools of the
   region want and have not started yet.
2. **Decide**, with the state kept from the last tick (``Pool.autoscaler_state``:
   in the database, so it survives a worker restart and needs no Redis).
3. **Write.** When the policy changes the size (its desired size differs from the
   replicas the pool has) and that differs from the size the agents aim at (a
   scale-up smaller than that size, taken before the agents wrote the rows of
   the replicas asked for, is not written), the
   new ``desired_replicas`` is written compare-and-set on the value read (an
   operator's or another worker's change in between wins, and no row is written),
   with one ``ScalingDecision`` row; otherwise only the state is written. Rows are
   pruned to ``PLATFORM_AUTOSCALE_DECISIONS_KEPT`` per pool as new ones come.

The state also holds the last decision (its utilisation, panic, capacity exhausted,
the signals) and a count of changes per reason, which the pool state, the console
and ``/metrics`` (``pool_figures``, read at scrape time) show.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypedDict, cast

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Prefetch
from django.utils import timezone

from config.errors import InvalidRequest
from engine_nodes import services
from engine_nodes.domain.liveness import ReplicaState, is_silent
from engine_nodes.domain.load_shares import (
    gateway_load_key,
    gateways_seen_key,
    pool_admitted,
    sum_pool_load,
    sum_replica_tokens,
)
from engine_nodes.models import Replica, ScalingDecision
from metering.metrics import PoolLiveFigures, PoolScalingFigures
from models_registry.domain.autoscaler import (
    AutoscalerState,
    PoolKind,
    PoolSignals,
    Reason,
    ScalingSettings,
    ScheduleRule,
    decide,
)
from models_registry.domain.autoscaler import ScalingDecision as Decision
from models_registry.domain.scaling import (
    problem_field,
    schedule_rule_problems,
)
from models_registry.models import SCALING_FIELDS, Pool, PoolSchedule
from models_registry.pools import get_pool

logger = logging.getLogger(__name__)

# Replicas the node agents count for a pool (``reconcile_pools``): all but these.
_NOT_COUNTED = (ReplicaState.GONE.value, ReplicaState.DRAINING.value)
# Decisions the pool state and the console show.
LAST_DECISIONS = 5

FreeGpus = Callable[..., int]


@dataclass(frozen=True, slots=True)
class _Replicas:
    """A pool's replicas as one tick counts them."""

    serving: int = 0
    starting: int = 0
    tokens_in_flight: int = 0  # heartbeat figures of the serving ones
    engine_queue_depth: int = 0  # requests waiting inside the serving engines


@dataclass(frozen=True, slots=True)
class TickResult:
    """What one tick did to one pool."""

    pool_id: int
    decision: Decision
    written: bool  # desired_replicas changed (and a row was written)


# -- the JSON handed to views and the console (control.api.serializers draws them) --


class LastTick(TypedDict):
    """What a tick saw and decided, kept in ``Pool.autoscaler_state["last"]``."""

    at: str  # ISO 8601
    current: int
    desired: int
    reason: str  # a Reason value
    utilisation: float | None
    stable_utilisation: float | None
    is_panicking: bool
    is_capacity_exhausted: bool
    capacity_is_assumed: bool
    warm_nodes: int  # idle nodes with the weights on disk the policy asks for
    load_source: str
    signals: dict[str, float]


class ScheduleRuleOut(TypedDict):
    """A schedule row: at least ``min_replicas`` on these weekdays, these minutes."""

    weekdays: list[int]
    start_minute: int
    end_minute: int
    min_replicas: int


class AutoscalingOut(TypedDict):
    """A pool's autoscaling settings (``SCALING_FIELDS``) and schedule."""

    model: str
    version: str
    region: str
    min_replicas: int
    max_replicas: int
    warm_floor: int
    target_utilisation: float
    scale_down_utilisation: float
    stable_window_s: float
    panic_window_s: float
    panic_factor: float
    scale_down_interval_s: float
    warm_nodes_min: int
    warm_nodes_max: int
    warm_horizon_s: float
    desired_replicas: int
    schedule: list[ScheduleRuleOut]


class DecisionOut(TypedDict):
    """One ``ScalingDecision`` row: a size the autoscaler changed, and why."""

    decided_at: str  # ISO 8601
    from_replicas: int
    to_replicas: int
    reason: str  # a Reason value
    utilisation: float | None
    is_panicking: bool
    is_capacity_exhausted: bool
    capacity_is_assumed: bool
    signals: dict[str, float]


class PoolScalingOut(TypedDict):
    """What the autoscaler adds to a pool of the pool state.

    ``kind`` is what the pool serves (``chat`` or ``embedding``); an embedding
    pool's capacity is ``replica_tokens_per_s`` input tokens/s a replica
    (``capacity_tokens_per_s`` for its serving ones), what the autoscaler sizes it
    on, and ``admitted_tokens_per_s`` the input tokens/s its last tick measured
    (all None for a chat pool).
    """

    kind: str
    desired_replicas: int
    starting_replicas: int
    replica_tokens_in_flight: int
    replica_tokens_per_s: float | None
    capacity_tokens_per_s: float | None
    admitted_tokens_per_s: float | None
    capacity_is_assumed: bool
    utilisation: float | None
    stable_utilisation: float | None
    autoscaler_tokens_in_flight: int | None
    autoscaler_queued_tokens: int | None
    autoscaler_queue_depth: int | None
    is_capacity_exhausted: bool
    is_panicking: bool
    last_reason: str | None
    warm_nodes: int  # the last tick's warm-node target (0: no warm pool)
    observed_at: str | None  # ISO 8601, the last tick's
    warnings: list[str]
    autoscaling: AutoscalingOut
    decisions: list[DecisionOut]


class ReplicaStateOut(TypedDict):
    """A replica of the pool state, as ``engine_nodes.services.pool_state`` lists it."""

    replica_id: str
    version: str
    region: str
    node: str
    state: str
    is_silent: bool
    queue_depth: int
    tokens_in_flight: int
    kv_cache_usage_perc: float
    last_heartbeat: str | None  # ISO 8601


class PoolLiveOut(TypedDict):
    """A pool's live figures: the gateways' (``metering.domain.pool_live`` over
    ``engine_nodes.services.LIVE_FIGURES_WINDOW``, and the routers' load now).

    The ``router_*`` figures are the gateways' live-load shares in this region's
    Redis: null for another region's pool, or when Redis does not answer.
    """

    requests: int
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p95_ms: float | None
    prefix_hit_rate: float | None
    usd_per_million_tokens: float | None
    router_tokens_in_flight: int | None
    router_queue_depth: int | None
    router_utilisation: float | None


class PoolOut(PoolScalingOut, PoolLiveOut):
    """A pool of the pool state: the fleet's figures, then the autoscaler's."""

    version: str
    region: str
    min_replicas: int
    max_replicas: int
    serving_replicas: int
    capacity_tokens_in_flight: int
    capacity_is_measured: bool


class PoolStateOut(TypedDict):
    """``GET /admin/pools/{model}/state``: a model's replicas, load and pools."""

    model: str
    region: str | None
    replicas: list[ReplicaStateOut]
    queue_depth: int
    tokens_in_flight: int
    prefix_hit_rate: float | None
    pools: list[PoolOut]


@contextlib.contextmanager
def region_redis() -> Iterator[redis.Redis | None]:
    """Yield a client of this region's Redis (short timeouts), or None without one."""
    if not settings.REDIS_URL:
        yield None
        return
    with redis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2
    ) as client:
        yield client


# -- settings ---------------------------------------------------------------------


def scaling_settings(
    pool: Pool, schedule: Iterable[PoolSchedule] = ()
) -> ScalingSettings:
    """Return the policy's settings of ``pool`` with ``schedule`` (its stored rows).

    Raises:
        ValueError: the stored settings make no sense (written around the checks).
    """
    return ScalingSettings(
        min_replicas=pool.min_replicas,
        max_replicas=pool.max_replicas,
        warm_floor=pool.warm_floor,
        target_utilisation=pool.target_utilisation,
        scale_down_utilisation=pool.scale_down_utilisation,
        stable_window_s=pool.stable_window_s,
        panic_window_s=pool.panic_window_s,
        panic_factor=pool.panic_factor,
        scale_down_interval_s=pool.scale_down_interval_s,
        warm_nodes_min=pool.warm_nodes_min,
        warm_nodes_max=pool.warm_nodes_max,
        warm_horizon_s=pool.warm_horizon_s,
        schedule=tuple(
            ScheduleRule(
                weekdays=frozenset(row.weekdays),
                start_minute=row.start_minute,
                end_minute=row.end_minute,
                min_replicas=row.min_replicas,
            )
            for row in schedule
        ),
    )


# -- observing ----------------------------------------------------------------------


def read_load_shares(
    client: redis.Redis, *, prefix: str, region: str
) -> dict[str, dict[str, int]]:
    """Return the live-load share of each gateway process of ``region``, by its id.

    Every process listed is read, whatever its score: a process gone silent has its
    share expire within the missed-beat window, and the score is the gateway's own
    clock, which this machine's need not match.

    Raises:
        redis.RedisError: Redis did not answer.
    """
    members = client.zrange(gateways_seen_key(prefix, region), 0, -1)
    gateway_ids = sorted(_text(m) for m in members if isinstance(m, bytes | str))
    if not gateway_ids:
        return {}
    pipe = client.pipeline(transaction=False)
    for gateway_id in gateway_ids:
        pipe.hgetall(gateway_load_key(prefix, region, gateway_id))
    shares = {}
    for gateway_id, raw in zip(gateway_ids, pipe.execute(), strict=True):
        share: dict[str, int] = {}
        for key, value in raw.items():
            try:
                share[_text(key)] = int(value)
            except ValueError:
                continue
        shares[gateway_id] = share
    return shares


def _count_replicas(
    *, region: str, version_ids: Sequence[int], now: datetime
) -> dict[int, _Replicas]:
    """Return each version's replicas in ``region`` as the tick counts them."""
    beat_s = settings.PLATFORM_HEARTBEAT_DB_S
    missed = settings.PLATFORM_MISSED_BEATS
    # version id -> [serving, starting, tokens in flight, engine queue depth]
    totals: dict[int, list[int]] = {}
    rows = (
        Replica.objects.filter(region=region, version_id__in=list(version_ids))
        .exclude(state__in=_NOT_COUNTED)
        .values_list(
            "version_id", "state", "last_heartbeat", "tokens_in_flight", "queue_depth"
        )
    )
    for version_id, state, last_heartbeat, tokens, queue_depth in rows:
        counted = totals.setdefault(version_id, [0, 0, 0, 0])
        if state == ReplicaState.SERVING and not is_silent(
            last_heartbeat, now, beat_s, missed
        ):
            counted[0] += 1
            counted[2] += tokens
            counted[3] += queue_depth
        else:
            counted[1] += 1
    return {version_id: _Replicas(*counted) for version_id, counted in totals.items()}


def replica_capacity(pool: Pool) -> tuple[int, bool]:
    """Return the tokens in flight one replica of the pool carries, and whether that
    is the platform's default (no load test has measured it)."""
    return pool.replica_capacity(settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT)


def replica_tokens_per_s(pool: Pool) -> tuple[float, bool]:
    """Return the input tokens/s one replica of an embedding pool sustains at its
    latency target, and whether that is the platform's default (not measured)."""
    return pool.replica_tokens_per_s(
        settings.PLATFORM_DEFAULT_EMBEDDING_REPLICA_TOKENS_PER_S
    )


def pool_kind(pool: Pool) -> PoolKind:
    """Return what the pool serves (its model's kind)."""
    return PoolKind(pool.model.kind)


def pool_signals(
    pool: Pool,
    *,
    at: float,
    replicas: _Replicas,
    shares: dict[str, dict[str, int]] | None,
    free_gpus: int,
) -> PoolSignals:
    """Return the policy's observation of ``pool`` (see the module docstring)."""
    per_replica, is_assumed = replica_capacity(pool)
    kind = pool_kind(pool)
    per_replica_s = 0.0
    admitted: dict[str, int] | None = None
    if kind == PoolKind.EMBEDDING:
        per_replica_s, is_assumed = replica_tokens_per_s(pool)
        if shares is not None:
            admitted = pool_admitted(shares, pool.model_id, pool.version.version)
    if shares is None:
        tokens_in_flight, queued_tokens, gateway_queue = replicas.tokens_in_flight, 0, 0
    else:
        load = sum_pool_load(shares.values(), pool.model_id, pool.version.version)
        tokens_in_flight, queued_tokens, gateway_queue = (
            load.tokens_in_flight,
            load.queued_tokens,
            load.queue_depth,
        )
    return PoolSignals(
        at=at,
        serving=replicas.serving,
        starting=replicas.starting,
        tokens_in_flight=tokens_in_flight,
        queued_tokens=queued_tokens,
        queue_depth=gateway_queue + replicas.engine_queue_depth,
        replica_tokens_in_flight=per_replica,
        capacity_is_assumed=is_assumed,
        gpus_per_replica=pool.version.gpus_per_replica,
        free_gpus=max(0, free_gpus),
        kind=kind,
        admitted_tokens=admitted,
        replica_tokens_per_s=per_replica_s,
    )


# -- the tick -------------------------------------------------------------------------


def autoscale_region(
    *,
    region: str,
    now: datetime,
    redis_client: redis.Redis | None = None,
    free_gpus: FreeGpus = services.free_gpus,
) -> list[TickResult]:
    """Size every pool of ``region`` once; return what each pool's tick did.

    ``redis_client`` is the region's Redis (the gateways' live load); None reads
    the replicas' heartbeats instead. A pool whose stored settings the policy
    refuses is skipped with an error in the log.
    """
    pools = list(
        # A staging pool (the version gates') stays at its one replica.
        Pool.objects.filter(region=region, staging=False)
        .select_related("model", "version")
        .prefetch_related("schedule")
        .order_by("pk")
    )
    if not pools:
        return []
    at = now.timestamp()
    counts = _count_replicas(
        region=region, version_ids=[p.version_id for p in pools], now=now
    )
    shares = _shares(redis_client, region=region)
    # GPUs the region's nodes have free, per replica size (a replica never spans
    # nodes), and those that pools want but have not started yet: one pool's tick
    # must not count GPUs another pool of the region already claimed.
    free_by_size: dict[int, int] = {}
    pending = {
        pool.pk: max(0, pool.target_replicas - _current(counts, pool))
        * pool.version.gpus_per_replica
        for pool in pools
    }
    results = []
    for pool in pools:
        size = pool.version.gpus_per_replica
        if size not in free_by_size:
            free_by_size[size] = free_gpus(region, now=now, gpus_per_replica=size)
        claimed_elsewhere = sum(g for pk, g in pending.items() if pk != pool.pk)
        try:
            policy = scaling_settings(pool, pool.schedule.all())
        except ValueError as exc:
            logger.error(
                "pool %s: stored settings refused, not autoscaled: %s", pool, exc
            )
            continue
        signals = pool_signals(
            pool,
            at=at,
            replicas=counts.get(pool.version_id, _Replicas()),
            shares=shares,
            free_gpus=free_by_size[size] - claimed_elsewhere,
        )
        result = _tick(
            pool,
            policy,
            signals,
            now=now,
            source="beats" if shares is None else "gateways",
        )
        if result is not None:
            results.append(result)
            desired = (
                result.decision.desired if result.written else pool.target_replicas
            )
            pending[pool.pk] = max(0, desired - signals.current) * size
    return results


def _current(counts: dict[int, _Replicas], pool: Pool) -> int:
    found = counts.get(pool.version_id, _Replicas())
    return found.serving + found.starting


def _shares(
    redis_client: redis.Redis | None, *, region: str
) -> dict[str, dict[str, int]] | None:
    if redis_client is None:
        return None
    try:
        return read_load_shares(
            redis_client, prefix=settings.REDIS_KEY_PREFIX, region=region
        )
    except redis.RedisError as exc:
        # The heartbeats still tell the replicas' load; the queues wait for Redis.
        logger.warning(
            "autoscaler: live load unreadable (%s), using heartbeats",
            type(exc).__name__,
        )
        return None


def _tick(
    pool: Pool,
    policy: ScalingSettings,
    signals: PoolSignals,
    *,
    now: datetime,
    source: str,
) -> TickResult | None:
    """Decide one pool and write the outcome; None when another writer won."""
    stored = pool.stored_state()
    state = AutoscalerState.from_dict(stored.get("state") or {})
    decision, state = decide(policy, state, signals)
    target = pool.target_replicas
    # A scale-up never lowers what the pool already asked for: until the agents
    # have written the rows of the replicas it asked for, a tick counts fewer than
    # the target, and its (smaller) scale-up would undo the larger one. Unless the
    # region has no GPUs for them: then the lower size frees the claim for others.
    is_undoing = (
        decision.current < decision.desired < target
        and not decision.is_capacity_exhausted
    )
    is_change = decision.changed and decision.desired != target and not is_undoing
    counts = dict(stored.get("decisions") or {})
    if is_change:
        counts[decision.reason.value] = int(counts.get(decision.reason.value, 0)) + 1
    # What it decided on: the policy's signals and the GPUs it was given.
    seen = {**decision.signals, "free_gpus": float(signals.free_gpus)}
    payload = {
        "state": state.as_dict(),
        "last": _last_dict(decision, now=now, source=source, signals=seen),
        "decisions": counts,
    }
    # Compare-and-set on the size read: an operator (or an overlapping tick) that
    # changed it meanwhile wins, and this tick writes nothing.
    claim = Pool.objects.filter(pk=pool.pk, desired_replicas=pool.desired_replicas)
    with transaction.atomic():
        if not is_change:
            updated = claim.update(autoscaler_state=payload)
            return TickResult(pool.pk, decision, written=False) if updated else None
        if (
            claim.update(desired_replicas=decision.desired, autoscaler_state=payload)
            != 1
        ):
            logger.info("pool %s: size changed meanwhile; this tick yields", pool)
            return None
        ScalingDecision.objects.create(
            pool=pool,
            region=pool.region,
            decided_at=now,
            from_replicas=target,
            to_replicas=decision.desired,
            reason=decision.reason.value,
            utilisation=decision.utilisation,
            is_panicking=decision.is_panicking,
            is_capacity_exhausted=decision.is_capacity_exhausted,
            capacity_is_assumed=decision.capacity_is_assumed,
            signals=seen,
        )
        prune_decisions(
            pool_id=pool.pk, keep=settings.PLATFORM_AUTOSCALE_DECISIONS_KEPT
        )
    logger.info(
        "pool %s: %d -> %d replicas (%s, utilisation %s)",
        pool,
        target,
        decision.desired,
        decision.reason.value,
        "n/a" if decision.utilisation is None else f"{decision.utilisation:.2f}",
    )
    return TickResult(pool.pk, decision, written=True)


def _last_dict(
    decision: Decision, *, now: datetime, source: str, signals: dict[str, float]
) -> LastTick:
    return {
        "at": now.isoformat(),
        "current": decision.current,
        "desired": decision.desired,
        "reason": decision.reason.value,
        "utilisation": decision.utilisation,
        "stable_utilisation": decision.stable_utilisation,
        "is_panicking": decision.is_panicking,
        "is_capacity_exhausted": decision.is_capacity_exhausted,
        "capacity_is_assumed": decision.capacity_is_assumed,
        "warm_nodes": decision.warm_nodes,
        "load_source": source,
        "signals": signals,
    }


def prune_decisions(*, pool_id: int, keep: int) -> int:
    """Delete the pool's decision rows beyond its ``keep`` newest; return how many."""
    stale = list(
        ScalingDecision.objects.filter(pool_id=pool_id)
        .order_by("-decided_at", "-id")
        .values_list("pk", flat=True)[keep:]
    )
    if not stale:
        return 0
    deleted, _ = ScalingDecision.objects.filter(pk__in=stale).delete()
    return deleted


# -- reading --------------------------------------------------------------------------


def autoscaling_dict(
    pool: Pool, schedule: Iterable[PoolSchedule] | None = None
) -> AutoscalingOut:
    """Return a pool's autoscaling settings and schedule as the API shows them."""
    rows = pool.schedule.all() if schedule is None else schedule
    return {
        "model": pool.model_id,
        "version": pool.version.version,
        "region": pool.region,
        # SCALING_FIELDS, in their order:
        "min_replicas": pool.min_replicas,
        "max_replicas": pool.max_replicas,
        "warm_floor": pool.warm_floor,
        "target_utilisation": pool.target_utilisation,
        "scale_down_utilisation": pool.scale_down_utilisation,
        "stable_window_s": pool.stable_window_s,
        "panic_window_s": pool.panic_window_s,
        "panic_factor": pool.panic_factor,
        "scale_down_interval_s": pool.scale_down_interval_s,
        "warm_nodes_min": pool.warm_nodes_min,
        "warm_nodes_max": pool.warm_nodes_max,
        "warm_horizon_s": pool.warm_horizon_s,
        "desired_replicas": pool.target_replicas,
        "schedule": [
            {
                "weekdays": list(row.weekdays),
                "start_minute": row.start_minute,
                "end_minute": row.end_minute,
                "min_replicas": row.min_replicas,
            }
            for row in rows
        ],
    }


def pool_state(
    *, model_id: str, now: datetime, region: str | None = None
) -> PoolStateOut:
    """Return the seed's pool state with, per pool, what the autoscaler sees and did.

    Per pool: capacity per replica (and whether it is assumed), desired, serving
    and starting replicas, the last tick's utilisation, panic and capacity
    exhausted, the settings and the last decisions, and warnings for an operator.
    """
    # engine_nodes.services builds the fleet's part untyped; PoolStateOut is its
    # shape with _pool_scaling's keys (control/tests/test_pool_api.py checks it).
    state = services.pool_state(
        model_id=model_id,
        now=now,
        region=region,
        prefetch=(
            "schedule",
            Prefetch(
                "scaling_decisions",
                queryset=ScalingDecision.objects.order_by("-decided_at", "-id")[
                    :LAST_DECISIONS
                ],
                to_attr="last_decisions",
            ),
        ),
        describe_pool=lambda pool, starting: dict(_pool_scaling(pool, starting)),
    )
    for pool in state["pools"]:
        if pool["replica_tokens_per_s"] is not None:
            pool["capacity_tokens_per_s"] = (
                pool["serving_replicas"] * pool["replica_tokens_per_s"]
            )
    _add_router_load(state, region=region)
    return cast(PoolStateOut, state)


def pool_live_figures(
    *, region: str | None = None, now: datetime | None = None
) -> list[PoolLiveFigures]:
    """Return each pool's live figures for ``/metrics`` (read at scrape time).

    The pools of ``region`` (this process's ``PLATFORM_REGION`` by default), read
    through ``pool_state`` model by model: the entries the admin API and the
    console show, so the three never disagree.
    """
    region = settings.PLATFORM_REGION if region is None else region
    now = now or timezone.now()
    models = sorted(
        set(Pool.objects.filter(region=region).values_list("model_id", flat=True))
    )
    figures = []
    for model_id in models:
        for pool in pool_state(model_id=model_id, now=now, region=region)["pools"]:
            figures.append(
                PoolLiveFigures(
                    model=model_id,
                    version=pool["version"],
                    region=pool["region"],
                    requests=pool["requests"],
                    ttft_p95_s=_seconds(pool["ttft_p95_ms"]),
                    ttft_p99_s=_seconds(pool["ttft_p99_ms"]),
                    tpot_p50_s=_seconds(pool["tpot_p50_ms"]),
                    tpot_p95_s=_seconds(pool["tpot_p95_ms"]),
                    prefix_hit_rate=pool["prefix_hit_rate"],
                    usd_per_million_tokens=pool["usd_per_million_tokens"],
                    router_utilisation=pool["router_utilisation"],
                )
            )
    return figures


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _add_router_load(state: dict[str, Any], *, region: str | None) -> None:
    """Add each pool's router load (``PoolLiveOut``'s ``router_*``) to ``state``.

    Only this region's pools: their gateways publish to this region's Redis.
    """
    here = settings.PLATFORM_REGION
    shares: dict[str, dict[str, int]] | None = None
    if region in (None, here) and any(p["region"] == here for p in state["pools"]):
        with region_redis() as client:
            shares = _shares(client, region=here)
    for pool in state["pools"]:
        tokens = queue = utilisation = None
        if shares is not None and pool["region"] == here:
            ids = [
                r["replica_id"]
                for r in state["replicas"]
                if r["version"] == pool["version"] and r["region"] == here
            ]
            tokens = sum_replica_tokens(shares.values(), ids)
            queue = sum_pool_load(
                shares.values(), state["model"], pool["version"]
            ).queue_depth
            capacity = pool["capacity_tokens_in_flight"]
            utilisation = tokens / capacity if capacity else None
        pool["router_tokens_in_flight"] = tokens
        pool["router_queue_depth"] = queue
        pool["router_utilisation"] = utilisation


def _pool_scaling(pool: Pool, starting: int) -> PoolScalingOut:
    per_replica, is_assumed = replica_capacity(pool)
    kind = pool_kind(pool)
    per_replica_s: float | None = None
    if kind == PoolKind.EMBEDDING:
        per_replica_s, is_assumed = replica_tokens_per_s(pool)
    last = pool.last_tick()
    signals = last.get("signals")
    if not isinstance(signals, dict):
        signals = {}
    is_exhausted = bool(last.get("is_capacity_exhausted"))
    warnings: list[str] = []
    if is_exhausted:
        warnings.append(
            "capacity exhausted: the region's nodes have no GPUs for the replicas "
            f"this pool needs ({int(signals.get('needed', 0))} wanted, "
            f"{last.get('desired', pool.target_replicas)} possible)"
        )
    if is_assumed and per_replica_s is not None:
        warnings.append(
            f"capacity assumed: {pool.version} has no load test; each replica is "
            f"taken to sustain {per_replica_s:g} input tokens/s "
            "(PLATFORM_DEFAULT_EMBEDDING_REPLICA_TOKENS_PER_S)"
        )
    elif is_assumed:
        warnings.append(
            f"capacity assumed: {pool.version} has no load test; each replica is "
            f"taken to carry {per_replica} tokens in flight "
            "(PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT)"
        )
    admitted = signals.get("admitted_tokens_per_s")
    return {
        "kind": kind.value,
        "desired_replicas": pool.target_replicas,
        "starting_replicas": starting,
        "replica_tokens_in_flight": per_replica,
        "replica_tokens_per_s": per_replica_s,
        "capacity_tokens_per_s": None,  # serving x per replica: pool_state's
        "admitted_tokens_per_s": (
            None if per_replica_s is None or admitted is None else float(admitted)
        ),
        "capacity_is_assumed": is_assumed,
        "utilisation": last.get("utilisation"),
        "stable_utilisation": last.get("stable_utilisation"),
        "autoscaler_tokens_in_flight": _int_or_none(signals.get("tokens_in_flight")),
        "autoscaler_queued_tokens": _int_or_none(signals.get("queued_tokens")),
        "autoscaler_queue_depth": _int_or_none(signals.get("queue_depth")),
        "is_capacity_exhausted": is_exhausted,
        "is_panicking": bool(last.get("is_panicking")),
        "last_reason": last.get("reason"),
        "warm_nodes": int(last.get("warm_nodes") or 0),
        "observed_at": last.get("at"),
        "warnings": warnings,
        "autoscaling": autoscaling_dict(pool),
        "decisions": [
            decision_dict(row) for row in getattr(pool, "last_decisions", [])
        ],
    }


def decision_dict(row: ScalingDecision) -> DecisionOut:
    """Return a decision row as the API shows it."""
    return {
        "decided_at": row.decided_at.isoformat(),
        "from_replicas": row.from_replicas,
        "to_replicas": row.to_replicas,
        "reason": row.reason,
        "utilisation": row.utilisation,
        "is_panicking": row.is_panicking,
        "is_capacity_exhausted": row.is_capacity_exhausted,
        "capacity_is_assumed": row.capacity_is_assumed,
        "signals": row.signals,
    }


def pool_figures(
    *, region: str | None = None, now: datetime | None = None
) -> list[PoolScalingFigures]:
    """Return each pool's autoscaling figures for ``/metrics`` (read at scrape time).

    The pools of ``region`` (this process's ``PLATFORM_REGION`` by default): the
    worker that decides exports nothing itself, so every process Prometheus
    scrapes reads the same figures from the database (two queries).
    """
    region = settings.PLATFORM_REGION if region is None else region
    now = now or timezone.now()
    pools = list(Pool.objects.filter(region=region).select_related("model", "version"))
    counts = _count_replicas(
        region=region, version_ids=[p.version_id for p in pools], now=now
    )
    figures = []
    for pool in pools:
        stored = pool.stored_state()
        last = pool.last_tick()
        replicas = counts.get(pool.version_id, _Replicas())
        _, is_assumed = replica_capacity(pool)
        kind = pool_kind(pool)
        capacity_s = None
        if kind == PoolKind.EMBEDDING:
            per_replica_s, is_assumed = replica_tokens_per_s(pool)
            capacity_s = replicas.serving * per_replica_s
        figures.append(
            PoolScalingFigures(
                model=pool.model_id,
                version=pool.version.version,
                region=pool.region,
                desired_replicas=pool.target_replicas,
                serving_replicas=replicas.serving,
                starting_replicas=replicas.starting,
                utilisation=last.get("utilisation"),
                is_capacity_exhausted=bool(last.get("is_capacity_exhausted")),
                capacity_is_assumed=is_assumed,
                is_panicking=bool(last.get("is_panicking")),
                decisions={
                    reason: int(count)
                    for reason, count in (stored.get("decisions") or {}).items()
                    if reason in _REASONS
                },
                kind=kind.value,
                capacity_input_tokens_per_s=capacity_s,
            )
        )
    return figures


_REASONS = frozenset(r.value for r in Reason)


# -- changing the settings -------------------------------------------------------------


def set_pool_autoscaling(
    *, model_id: str, version: str, region: str, changes: dict[str, Any]
) -> Pool:
    """Change a pool's autoscaling settings; ``changes["schedule"]``, when given,
    replaces its schedule rows. Fields not given keep their values.

    Raises:
        InvalidRequest: the settings and schedule together make no sense (the
            error's param names the field, ``schedule.<n>.<field>`` for a row).
        NotFound: no such pool.
    """
    with transaction.atomic():
        pool = get_pool(
            model_id=model_id, version=version, region=region, for_update=True
        )
        for name in SCALING_FIELDS:
            if name in changes:
                setattr(pool, name, changes[name])
        if "schedule" in changes:
            rows = [PoolSchedule(pool=pool, **rule) for rule in changes["schedule"]]
        else:
            rows = list(pool.schedule.all())
        for index, row in enumerate(rows):
            for problem in schedule_rule_problems(
                weekdays=row.weekdays,
                start_minute=row.start_minute,
                end_minute=row.end_minute,
                min_replicas=row.min_replicas,
            ):
                field = problem_field(problem)
                raise InvalidRequest(
                    f"schedule[{index}].{problem}", param=f"schedule.{index}.{field}"
                )
        problems = pool.scaling_problems(rows)
        if problems:
            raise InvalidRequest(problems[0], param=problem_field(problems[0]))
        # Only the settings: desired_replicas and the state are the autoscaler's.
        pool.save(update_fields=list(SCALING_FIELDS))
        if "schedule" in changes:
            pool.schedule.all().delete()
            for row in rows:
                row.weekdays = sorted(set(row.weekdays))
            PoolSchedule.objects.bulk_create(rows)
    return Pool.objects.select_related("model", "version").get(pk=pool.pk)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
