"""Use-cases for replicas and nodes: heartbeats, the reaper, free GPUs, a pool's state."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Prefetch, Sum
from django.utils import timezone

from engine_nodes.domain.beats import ReplicaBeat
from engine_nodes.domain.convergence import ReplicaView, StartReplica, converge_steps
from engine_nodes.domain.k8s import (
    SGLANG_CONFIG_PATH,
    DeploymentTemplate,
    FollowAction,
    PoolSpec,
    deployment_name,
)
from engine_nodes.domain.k8s_drain import ReplicaLoad
from engine_nodes.domain.k8s_pods import PodsPlan, ReplicaRow
from engine_nodes.domain.k8s_warm import warm_deployment_name
from engine_nodes.domain.liveness import ReplicaState, is_silent, silence_cutoff
from engine_nodes.domain.replica_argv import (
    ReplicaSpec,
    engine_for,
    engine_trace_args,
    engine_trace_env,
    is_kv_events_on,
    kv_events_url,
    sglang_launch_argv,
    vllm_serve_argv,
)
from engine_nodes.kubernetes_actuator import KubernetesActuator
from engine_nodes.models import Node, Replica
from metering.domain.cost import gpu_hour_usd_for, gpu_usd_per_hour
from metering.domain.figures import VersionFigures
from metering.domain.pool_live import pool_live
from metering.services import pool_live_figures
from models_registry.domain.capacity import CapacityRecord, pool_capacity_tokens
from models_registry.models import ModelVersion, Pool
from models_registry.services import get_model

logger = logging.getLogger(__name__)

# The window over which the pool state reads the pools' live figures (TTFT, time
# per output token, prefix hit rate, USD per million tokens).
LIVE_FIGURES_WINDOW = timedelta(minutes=5)
KUBERNETES_KV_EVENTS_PORT = 5557  # vLLM's default; each pod has its own IP


def reap_silent_replicas(
    *, now: datetime, heard: Collection[str] = frozenset(), region: str | None = None
) -> list[str]:
    """Mark replicas gone that missed ``PLATFORM_MISSED_BEATS`` heartbeats; return their ids.

    A replica that never beat is judged by its creation time, so one that dies while
    starting is reaped too. The update is a compare-and-set on the same condition:
    a replica whose heartbeat lands between the read and the write is left alone.
    ``heard``: replicas whose beats reach the routers now (the region's Redis):
    never reaped, whatever the database heard. Their agent beats to Redis while
    its database writes fail or wait (a partition between it and the database,
    or the database just back from an outage), and gateways route to them.
    ``region``: reap only that region's replicas (None: every region's).
    """
    cutoff = silence_cutoff(
        now, settings.PLATFORM_HEARTBEAT_DB_S, settings.PLATFORM_MISSED_BEATS
    )
    silent = Replica.objects.live().silent(cutoff).exclude(replica_id__in=heard)
    if region is not None:
        silent = silent.filter(region=region)
    reaped = []
    for replica_id in list(silent.values_list("replica_id", flat=True)):
        updated = silent.filter(replica_id=replica_id).update(state=ReplicaState.GONE)
        if updated == 1:
            reaped.append(replica_id)
    if reaped:
        logger.info("reaped %d silent replicas: %s", len(reaped), ", ".join(reaped))
    return reaped


def record_node_beat(
    *,
    node: str,
    region: str,
    gpus: int,
    now: datetime,
    warm_version_ids: Iterable[int] | None = None,
) -> tuple[Node, bool]:
    """Write that ``node``'s agent is alive with ``gpus`` GPUs; return (row, created).

    ``warm_version_ids`` (when given) replaces the versions whose weights the node
    holds on local disk; None leaves them as they are, so an agent writes them
    only when they change (and again when its row was created anew, say after an
    operator deleted it). Ids of versions deleted meanwhile are skipped.
    """
    with transaction.atomic():
        row, created = Node.objects.update_or_create(
            region=region, name=node, defaults={"gpus": gpus, "last_beat": now}
        )
        if warm_version_ids is not None:
            wanted = set(warm_version_ids)
            existing = ModelVersion.objects.filter(pk__in=wanted).values_list(
                "pk", flat=True
            )
            row.warm_versions.set(list(existing))
    return row, created


def forget_node(*, node: str, region: str) -> None:
    """Delete a node's row: its agent is shutting down and offers no GPUs."""
    Node.objects.filter(region=region, name=node).delete()


def live_nodes(*, region: str, now: datetime) -> list[Node]:
    """Return the region's nodes heard from within the missed-beat window."""
    cutoff = silence_cutoff(
        now, settings.PLATFORM_HEARTBEAT_DB_S, settings.PLATFORM_MISSED_BEATS
    )
    return list(Node.objects.filter(region=region).heard_since(cutoff))


def gpus_in_use(*, region: str, nodes: Iterable[str]) -> dict[str, int]:
    """Return the GPUs that non-gone replicas hold on each of ``nodes``.

    Starting, loading, draining and stalled replicas hold their GPUs as serving
    ones do; a replica's row is deleted once its process has stopped.
    """
    used: dict[str, int] = dict.fromkeys(nodes, 0)
    rows = (
        Replica.objects.live()
        .filter(region=region, node__in=list(used))
        .values("node")
        .annotate(gpus=Sum("version__gpus_per_replica"))
    )
    for row in rows:
        used[row["node"]] = int(row["gpus"] or 0)
    return used


def free_gpus(
    region: str, *, now: datetime | None = None, gpus_per_replica: int = 1
) -> int:
    """Return the GPUs the region's live nodes have free beyond their replicas.

    The sum over nodes heard from within the missed-beat window of their GPUs less
    those their non-gone replicas hold (a node never counts below zero). With
    ``gpus_per_replica`` above 1, a node counts only the whole replicas of that
    size it can hold (a replica never spans nodes): two nodes with one free GPU
    each have 0 free for 2-GPU replicas, not 2. A region with no live node has 0:
    nothing can start there (the autoscaler reports ``capacity_exhausted``).
    """
    if gpus_per_replica < 1:
        raise ValueError("gpus_per_replica must be at least 1")
    nodes = live_nodes(region=region, now=now or timezone.now())
    used = gpus_in_use(region=region, nodes=[n.name for n in nodes])
    free = 0
    for node in nodes:
        spare = max(0, node.gpus - used[node.name])
        free += spare - spare % gpus_per_replica
    return free


def replica_url(host: str, port: int) -> str:
    """Return the base URL of a replica's OpenAI server."""
    return f"http://{host}:{port}"


def lock_region_pools(region: str) -> list[Pool]:
    """Lock ``region``'s pool rows (their versions loaded) for the transaction.

    Only the pool rows, and FOR NO KEY UPDATE: agents serialize on them, while
    the rows a pass inserts or a rollout writes meanwhile (a replica naming the
    model, a model naming its canary version) take no lock a pass holds. A lock
    on the joined versions once deadlocked a rollout's step against a pass.
    """
    return list(
        Pool.objects.select_for_update(no_key=True, of=("self",))
        .filter(region=region)
        .select_related("version")
        .order_by("model_id", "version_id")
    )


def reconcile_pools(
    *,
    region: str,
    node: str,
    gpus_free: int,
    allocate_port: Callable[[], int],
    host: str,
    now: datetime | None = None,
    skip_version_ids: Collection[int] = (),
) -> tuple[list[Replica], list[str]]:
    """Move each pool of ``region`` toward its target size; return the changes.

    What to do about each pool is ``engine_nodes.domain.convergence``'s step
    (``converge_steps``; the fleet simulator drives the same one): starting and loading replicas count toward the target; above it, replicas
    that never served are cancelled, then one replica at a time is marked
    ``draining`` (the least loaded, only while the others serving make the
    target), whichever node holds it: that node's agent drains and stops it.
    Short pools get new replicas on ``node`` (state ``starting``) while its free
    GPUs last, except for versions in ``skip_version_ids`` (their weights failed
    on this node: another node may fill the gap). Runs under a lock on the pool
    rows, so agents on several nodes neither fill the same gap twice nor drain
    two replicas of a pool at once. Returns (created replicas, ids marked
    draining).
    """
    now = now or timezone.now()
    beat_s = settings.PLATFORM_HEARTBEAT_DB_S
    missed = settings.PLATFORM_MISSED_BEATS
    created: list[Replica] = []
    drained: list[str] = []
    with transaction.atomic():
        pools = lock_region_pools(region)
        for pool in pools:
            replicas = list(
                Replica.objects.filter(version=pool.version, region=region).exclude(
                    state=ReplicaState.GONE
                )
            )
            steps = converge_steps(
                pool.target_replicas,
                [
                    ReplicaView(
                        replica_id=r.replica_id,
                        state=r.state,
                        tokens_in_flight=r.tokens_in_flight,
                        created_at=r.created_at.timestamp(),
                        # A starting replica has not beaten yet; only serving
                        # ones are judged by their silence.
                        is_silent=is_silent(r.last_heartbeat, now, beat_s, missed),
                    )
                    for r in replicas
                ],
            )
            states = {r.replica_id: r.state for r in replicas}
            done: bool | None = None  # the answer to the last effect
            while True:
                try:
                    effect = next(steps) if done is None else steps.send(done)
                except StopIteration:
                    break
                if isinstance(effect, StartReplica):
                    gpus = pool.version.gpus_per_replica
                    done = pool.version_id not in skip_version_ids and gpus <= gpus_free
                    if done:
                        created.append(
                            _create_replica(
                                pool,
                                region=region,
                                node=node,
                                host=host,
                                allocate_port=allocate_port,
                            )
                        )
                        gpus_free -= gpus
                else:
                    # Cancelled or drained, the row says draining: the agent holding
                    # it stops it (at once when it never served). Compare-and-set:
                    # a replica that changed state meanwhile is left alone.
                    done = bool(
                        Replica.objects.filter(
                            pk=effect.replica_id, state=states[effect.replica_id]
                        ).update(state=ReplicaState.DRAINING)
                    )
                    if done:
                        drained.append(effect.replica_id)
    return created, drained


def _create_replica(
    pool: Pool, *, region: str, node: str, host: str, allocate_port: Callable[[], int]
) -> Replica:
    """Create a ``starting`` replica of ``pool`` on ``node`` on a port from
    ``allocate_port``, and a second one for KV events if its version has them."""
    port = allocate_port()
    kv_port = allocate_port() if is_kv_events_on(pool.version.engine_config) else 0
    return Replica.objects.create(
        # A port is reused once its replica is gone, and gone rows stay for the
        # record: the suffix keeps ids unique.
        replica_id=f"{pool.model_id}-{pool.version.version}-{region}-"
        f"{node}-{port}-{secrets.token_hex(3)}",
        model_id=pool.model_id,
        version=pool.version,
        region=region,
        node=node,
        url=replica_url(host, port),
        kv_events_url=kv_events_url(host, kv_port) if kv_port else "",
        state=ReplicaState.STARTING,
    )


def pool_versions(*, region: str) -> list[ModelVersion]:
    """Return the versions that have a pool in ``region`` (the warm pool's list)."""
    return list(
        ModelVersion.objects.filter(pools__region=region).distinct().order_by("pk")
    )


def replica_spec(
    version: ModelVersion,
    *,
    model_id: str,
    replica_id: str,
    weights_dir: str,
    host: str,
    port: int,
    kv_events_port: int = 0,
) -> ReplicaSpec:
    """Return how to start one replica of ``version``, served as ``model_id``
    (publishing KV events on ``kv_events_port`` when the version turns them on).

    Raises:
        ValueError: a field the spec refuses (``ReplicaSpec``'s invariants).
    """
    return ReplicaSpec(
        replica_id=replica_id,
        model=model_id,
        version=version.version,
        served_model_name=model_id,
        precision=version.precision,
        gpus_per_replica=version.gpus_per_replica,
        engine_config=version.engine_config,
        weights_dir=weights_dir,
        host=host,
        port=port,
        max_model_len=version.engine_config.get("max_model_len"),
        kv_events_port=kv_events_port,
    )


def kubernetes_pool_spec(pool: Pool, template: DeploymentTemplate) -> PoolSpec:
    """Return the Deployment spec of ``pool``: ``vllm serve`` (or SGLang's
    ``launch_server`` for an SGLang version) at its target size.

    ``replicas`` is ``pool.target_replicas``, so the Deployment follows what the
    autoscaler decided; the weights are the version's hash directory on the
    template's volume. The GPU type is the template's (``gpu_product_for``): the
    registry records none. A version with ``kv_events`` publishes them on
    ``KUBERNETES_KV_EVENTS_PORT``, which the pod then exposes. With the
    template's ``otlp_traces_endpoint`` the engine exports its own spans there
    (``engine_trace_args``, ``engine_trace_env``).

    Raises:
        ValueError: the version's engine config is unusable (``vllm_serve_argv``,
            ``sglang_launch_argv``), or it runs on SGLang and the template has no
            SGLang image.
    """
    version = pool.version
    weights_dir = template.weights_dir(version.weights_hash)
    replica = replica_spec(
        version,
        model_id=pool.model_id,
        replica_id=deployment_name(pool.model_id, version.version, pool.region),
        weights_dir=weights_dir,
        host="0.0.0.0",  # inside its pod: reached on the pod's IP
        port=template.port,
        kv_events_port=KUBERNETES_KV_EVENTS_PORT,
    )
    engine = engine_for(replica)
    kv_events = is_kv_events_on(version.engine_config)
    # SGLang reads its key from a file the pod's init container writes.
    config_file = SGLANG_CONFIG_PATH if template.api_key_secret else None
    argv = (
        sglang_launch_argv(replica, python="python3", config_file=config_file)
        if engine == "sglang"
        else vllm_serve_argv(replica)
    )
    argv += engine_trace_args(engine, template.otlp_traces_endpoint)
    trace_env = engine_trace_env(engine, template.otlp_traces_endpoint)
    return PoolSpec(
        model=pool.model_id,
        version=version.version,
        region=pool.region,
        replicas=pool.target_replicas,
        image=template.image_for(engine),
        engine=engine,
        gpus_per_replica=version.gpus_per_replica,
        argv=tuple(argv),
        weights_dir=weights_dir,
        port=template.port,
        startup_timeout_s=template.startup_timeout_s,
        drain_s=template.drain_s,
        api_key_secret=template.api_key_secret,
        api_key_secret_key=template.api_key_secret_key,
        gpu_product=template.gpu_product_for(pool.model_id, version.version),
        # Nodes' caches are what the weights DaemonSet labels; a PVC is shared.
        weights_hash=version.weights_hash if template.weights_host_root else "",
        kv_events_port=replica.kv_events_port if kv_events else 0,
        env=tuple(trace_env.items()),
        **template.volume(version.weights_hash),
    )


def follow_pools_on_kubernetes(
    *, actuator: KubernetesActuator, region: str, template: DeploymentTemplate
) -> dict[str, FollowAction]:
    """Bring every pool's Deployment in ``region`` to its target; say what each took.

    Returns {Deployment name: action} (``kubernetes_pool_specs``' pools), with the
    pools' warm-node placeholders (``engine_nodes.domain.k8s_warm``) at the count
    the autoscaler's last tick asked for, under their own Deployment names.
    """
    actions = {}
    for pool, spec in kubernetes_pool_specs(region=region, template=template):
        actions[spec.name] = actuator.follow_pool(spec)
        warm = pool.warm_target()
        action = actuator.follow_warm(spec, warm)
        if action != FollowAction.NONE or warm:
            actions[warm_deployment_name(spec)] = action
    return actions


def kubernetes_pool_specs(
    *, region: str, template: DeploymentTemplate
) -> list[tuple[Pool, PoolSpec]]:
    """Return each pool of ``region`` with its Deployment spec.

    A pool whose spec cannot be built (an unusable engine config) is logged and
    skipped: the others still follow.
    """
    specs = []
    pools = Pool.objects.filter(region=region).select_related("version")
    for pool in pools.order_by("model_id", "version_id"):
        try:
            specs.append((pool, kubernetes_pool_spec(pool, template)))
        except ValueError:
            logger.exception("pool %s has no usable Deployment spec", pool)
    return specs


def pod_replica_rows(*, deployment: str, region: str) -> dict[str, ReplicaRow]:
    """Return the rows of a Deployment's pods (ids ``<deployment>-...``) by id."""
    rows = Replica.objects.filter(
        region=region, replica_id__startswith=f"{deployment}-"
    )
    return {
        r.replica_id: ReplicaRow(
            state=r.state, url=r.url, node=r.node, kv_events_url=r.kv_events_url
        )
        for r in rows
    }


def apply_pod_replicas(plan: PodsPlan, *, pool: Pool) -> dict[str, str]:
    """Write ``plan``'s rows of ``pool``; return the state each pod's row holds now.

    A changed row is a compare-and-set on the state read: a row another writer
    moved meanwhile (the drain marked it draining) keeps its new state and is
    left out of the answer this time. Rows whose pod is gone are removed.
    """
    states: dict[str, str] = {}
    for replica in plan.replicas:
        if not replica.is_changed:
            states[replica.replica_id] = replica.state
            continue
        fields = {
            "state": replica.state,
            "url": replica.url,
            "node": replica.node,
            "kv_events_url": replica.kv_events_url,
        }
        if replica.was is None:
            _, is_new = Replica.objects.get_or_create(
                replica_id=replica.replica_id,
                defaults={
                    **fields,
                    "model_id": pool.model_id,
                    "version": pool.version,
                    "region": pool.region,
                },
            )
            moved = is_new
        else:
            rows = Replica.objects.filter(
                pk=replica.replica_id, state=replica.was.state
            )
            moved = bool(rows.update(**fields))
        if moved:
            states[replica.replica_id] = replica.state
    for replica_id in plan.removed:
        remove_replica(replica_id)
    return states


class DatabaseReplicaLedger:
    """The replicas of Kubernetes pods in the platform's database, keyed by pod name.

    The ``ReplicaLedger`` of ``KubernetesActuator``'s drain. A replica marked
    draining here leaves every gateway's ring at its next snapshot, as one a node
    agent's reconcile marks (``reconcile_pools``). A pod with no row (no heartbeat
    reaches the platform for it) has no streams known: it is drained to its
    deadline. Streams are the row's queue depth, plus one while it has tokens in
    flight (a row keeps no running count); a silent row knows none.
    """

    def loads(self, replica_ids: Collection[str]) -> dict[str, ReplicaLoad]:
        """Return each known replica's state and streams."""
        now = timezone.now()
        beat_s = settings.PLATFORM_HEARTBEAT_DB_S
        missed = settings.PLATFORM_MISSED_BEATS
        loads: dict[str, ReplicaLoad] = {}
        for replica in Replica.objects.live().filter(pk__in=list(replica_ids)):
            silent = is_silent(replica.last_heartbeat, now, beat_s, missed)
            streams = replica.queue_depth + (1 if replica.tokens_in_flight else 0)
            loads[replica.replica_id] = ReplicaLoad(
                state=replica.state,
                streams=None if silent else streams,
                tokens_in_flight=replica.tokens_in_flight,
            )
        return loads

    def mark_draining(self, replica_id: str) -> bool:
        """Mark the replica draining (compare-and-set from serving or stalled).

        True when it is draining now, or has no row (nothing routes to it by id).
        """
        return self._move(
            replica_id,
            (ReplicaState.SERVING, ReplicaState.STALLED),
            ReplicaState.DRAINING,
        )

    def mark_serving(self, replica_id: str) -> bool:
        """Mark a draining replica serving again (its pool's target rose)."""
        return self._move(replica_id, (ReplicaState.DRAINING,), ReplicaState.SERVING)

    def _move(self, replica_id: str, expected: Sequence[str], state: str) -> bool:
        if set_replica_state(replica_id, expected=expected, state=state):
            return True
        row = Replica.objects.live().filter(pk=replica_id)
        current = row.values_list("state", flat=True).first()
        return current is None or current == state


def set_replica_state(replica_id: str, *, expected: Iterable[str], state: str) -> bool:
    """Move a replica to ``state`` if it is in one of ``expected``; True if it moved."""
    return bool(
        Replica.objects.filter(pk=replica_id, state__in=list(expected)).update(
            state=state
        )
    )


def record_heartbeats(beats: Iterable[ReplicaBeat], *, now: datetime) -> int:
    """Write the latest load and ``last_heartbeat`` of beating replicas; return rows.

    Replicas already marked gone stay gone: a late beat from a replica the reaper
    gave up on does not revive it (its agent removes it and starts a new one).
    """
    written = 0
    for beat in beats:
        written += (
            Replica.objects.live()
            .filter(pk=beat.replica_id)
            .update(
                queue_depth=beat.queue_depth,
                tokens_in_flight=beat.tokens_in_flight,
                kv_cache_usage_perc=min(1.0, max(0.0, beat.kv_cache_usage_perc)),
                last_heartbeat=now,
            )
        )
    return written


def remove_replica(replica_id: str) -> None:
    """Delete a replica row once its process has stopped (seed: draining -> removed)."""
    Replica.objects.filter(pk=replica_id).delete()


def pool_state(
    *,
    model_id: str,
    now: datetime,
    region: str | None = None,
    prefetch: Sequence[str | Prefetch[Any]] = (),
    describe_pool: Callable[[Pool, int], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Return the seed's pool state: replicas, queue depth, tokens in flight, hit rate.

    Sums cover replicas that are serving and heard from within the missed-beat
    window; every non-gone replica is listed with its state and silence. Each
    pool carries its live figures over ``LIVE_FIGURES_WINDOW`` (the gateways'
    role ``pool`` figures: ``metering.domain.pool_live``), and the model's
    ``prefix_hit_rate`` is theirs summed over its pools (``region``'s). Each
    pool's entry is extended with ``describe_pool(pool, starting)`` when given
    (``starting``: the replicas the agents count that are not serving, i.e. all
    but serving and draining ones), the pools read with ``prefetch``.
    """
    model = get_model(model_id)
    beat_s = settings.PLATFORM_HEARTBEAT_DB_S
    missed = settings.PLATFORM_MISSED_BEATS
    replicas_qs = Replica.objects.live().filter(model=model).select_related("version")
    pools_qs = (
        Pool.objects.filter(model=model)
        .select_related("model", "version")
        .prefetch_related(*prefetch)
    )
    if region is not None:
        replicas_qs = replicas_qs.filter(region=region)
        pools_qs = pools_qs.filter(region=region)
    replicas = []
    serving_by_pool: dict[tuple[int, str], int] = {}
    starting_by_pool: dict[tuple[int, str], int] = {}
    held_by_pool: dict[tuple[int, str], int] = {}
    queue_depth = 0
    tokens_in_flight = 0
    for replica in replicas_qs:
        silent = is_silent(replica.last_heartbeat, now, beat_s, missed)
        is_serving = replica.state == ReplicaState.SERVING and not silent
        key = (replica.version_id, replica.region)
        held_by_pool[key] = held_by_pool.get(key, 0) + 1
        if is_serving:
            queue_depth += replica.queue_depth
            tokens_in_flight += replica.tokens_in_flight
            serving_by_pool[key] = serving_by_pool.get(key, 0) + 1
        elif replica.state != ReplicaState.DRAINING:
            starting_by_pool[key] = starting_by_pool.get(key, 0) + 1
        replicas.append(
            {
                "replica_id": replica.replica_id,
                "version": replica.version.version,
                "region": replica.region,
                "node": replica.node,
                "state": replica.state,
                "is_silent": silent,
                "queue_depth": replica.queue_depth,
                "tokens_in_flight": replica.tokens_in_flight,
                "kv_cache_usage_perc": replica.kv_cache_usage_perc,
                "last_heartbeat": (
                    replica.last_heartbeat.isoformat()
                    if replica.last_heartbeat
                    else None
                ),
            }
        )
    window = LIVE_FIGURES_WINDOW
    live = pool_live_figures(model_id=model.model, since=now - window, region=region)
    all_pools = sum(live.values(), VersionFigures())
    pools = []
    for pool in pools_qs:
        key = (pool.version_id, pool.region)
        figures = live.get((pool.version.version, pool.region), VersionFigures())
        usd_per_hour = gpu_usd_per_hour(
            gpus=held_by_pool.get(key, 0) * pool.version.gpus_per_replica,
            gpu_hour_usd=gpu_hour_usd_for(
                pool.region,
                default=settings.PLATFORM_GPU_HOUR_USD,
                by_region=settings.PLATFORM_GPU_HOUR_USD_BY_REGION,
            ),
        )
        serving = serving_by_pool.get(key, 0)
        capacity = CapacityRecord(
            tokens_per_s=pool.version.load_test_tokens_per_s,
            # A figure of 0 is no measurement, as admission and the autoscaler
            # read it: the pool is sized on the default.
            tokens_in_flight=pool.version.load_test_tokens_in_flight or None,
        )
        entry = {
            "version": pool.version.version,
            "region": pool.region,
            "min_replicas": pool.min_replicas,
            "max_replicas": pool.max_replicas,
            "serving_replicas": serving,
            "capacity_tokens_in_flight": pool_capacity_tokens(
                serving,
                capacity,
                settings.PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT,
            ),
            "capacity_is_measured": capacity.is_measured,
            **asdict(
                pool_live(
                    figures,
                    usd_per_hour=usd_per_hour,
                    window_s=window.total_seconds(),
                )
            ),
        }
        if describe_pool is not None:
            entry.update(describe_pool(pool, starting_by_pool.get(key, 0)))
        pools.append(entry)
    return {
        "model": model.model,
        "region": region,
        "replicas": replicas,
        "queue_depth": queue_depth,
        "tokens_in_flight": tokens_in_flight,
        "prefix_hit_rate": all_pools.prefix_hit_rate,
        "pools": pools,
    }
