"""The node agent: runs this node's share of every pool, and beats for each replica.

One agent runs per GPU node (``manage.py engine_agent --node N --region R``). Every
beat it:

1. hands its warm pool (``engine_nodes.warm_pool``) the versions of the region's
   pools: their weights are pulled (from the region's ready copy, ``weights_ref``)
   and verified in the background, ahead of need, so that a start on this node
   costs only load and warm-up; a version whose region copy is not ready is not
   started here;
2. reconciles the region's pools with the control plane
   (``engine_nodes.services.reconcile_pools``, ``engine_nodes.domain.convergence``):
   short pools get new replicas on this node while its GPUs last, starting ones
   counted; above target, replicas that never served are cancelled and one
   replica per pool at a time is marked draining (the least loaded, only while
   the others serving make the target);
3. moves each of its replicas along the seed's states: ``starting`` (waits for its
   weights, then its process starts) -> ``loading`` (process up, ``/health`` not
   yet 200) -> ``serving`` -> ``draining`` -> removed. A draining replica beats
   as such, so routers send it nothing new; once it has been draining for
   ``drain_settle_s`` (gateways may still act on its last serving beat until
   then) and its engine holds no request, it stops. At ``drain_timeout_s``
   (``PLATFORM_DRAIN_TIMEOUT_S``) it stops whatever it holds: the gateway ends
   each stream still open with its explicit error event. No stream is cut by a
   scale-down before that deadline;
4. scrapes each replica's ``/metrics`` and publishes a beat (queue depth, tokens in
   flight, KV usage) to Redis and to the database, and writes its node's row
   (GPUs, warm versions; ``engine_nodes.models.Node``), which
   ``services.free_gpus`` sums for the autoscaler.

Pulls and stops run in threads of their own: a 28-second pull or a replica slow
to exit never delays the other replicas' beats. So does the pass itself (steps 1-4,
which read and write the database): ``run`` beats on its own schedule, and while a
pass holds past its beat (the database slow, refusing or blackholed) it beats to
Redis from what the agent last knew (``_beat_from_last_known``).

A serving replica that holds requests but whose engine shows no progress for
``stall_after_s`` (``engine_nodes.domain.progress``: generated tokens, requests and
KV use all flat, on fresh scrapes) is marked ``stalled``: it beats on, so it is not
reaped, but routers skip it; it is ``serving`` again as soon as it moves. A hung
engine answers ``/health`` and ``/metrics`` as if nothing were wrong, so only its
figures tell.

Scrapes run in threads, all replicas at once, and a tick waits for them at most
``scrape_timeout_s``: one slow replica must not delay the others' beats. A scrape
still running then is not started again; its answer counts at the next tick. A
replica whose ``/metrics`` is slow but whose process lives keeps beating with its
last answer for up to ``scrape_grace_s``: real vLLM's API server can leave
``/metrics`` unanswered for seconds while it streams (measured on CPU: 3.6 s during
one 2,000-token stream), and a busy replica must not fall out of the ring. One that
stays silent longer misses its beats like a dead one.

A replica whose process dies stops beating; after the missed-beat window the
routers drop it and the reaper marks it gone, and the next reconcile starts a
replacement. The agent keeps no state that the database does not also hold, except
the process handles it started and what its warm pool verified.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Protocol

import httpx
from django.conf import settings
from django.db import close_old_connections
from django.db.models import prefetch_related_objects
from django.utils import timezone

from config.control_plane import is_database_unavailable
from engine_nodes import services
from engine_nodes.actuators import Actuator
from engine_nodes.domain.beats import ReplicaBeat
from engine_nodes.domain.liveness import ReplicaState
from engine_nodes.domain.progress import Progress, is_stalled, observe_progress
from engine_nodes.domain.replica_argv import ReplicaSpec
from engine_nodes.domain.scrape import EngineStats
from engine_nodes.metrics_scrape import beat_load, scrape_engine
from engine_nodes.models import Replica
from engine_nodes.warm_pool import Readiness, WarmPool, WeightsRef
from models_registry.domain.gates import RegionState
from models_registry.models import ModelVersion

logger = logging.getLogger(__name__)


class BeatSink(Protocol):
    """Where beats go besides the database (Redis in production)."""

    def publish(self, beats: list[ReplicaBeat]) -> int: ...

    def forget(self, replica_id: str, region: str) -> None: ...


@dataclass
class PortAllocator:
    """Hands out free TCP ports from a range, skipping ones in use."""

    host: str
    first: int
    last: int
    taken: set[int] = field(default_factory=set)

    def __call__(self) -> int:
        for port in range(self.first, self.last + 1):
            if port in self.taken:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((self.host, port))
                except OSError:
                    continue
            self.taken.add(port)
            return port
        raise RuntimeError(f"no free port in {self.first}-{self.last}")

    def release(self, port: int) -> None:
        self.taken.discard(port)


@dataclass
class _Running:
    handle: Any
    port: int
    started_at: float
    kv_events_port: int = 0
    gpus: int = 1
    has_served: bool = False
    drain_started_at: float | None = None
    stopping: Future[None] | None = None


# Stopping, the agent waits this long for its pass in flight (which may be
# starting a replica) before it stops its replicas.
_PASS_END_WAIT_S = 30.0
# A replica that never served (or is gone) holds no stream: this long to exit
# after SIGTERM, then SIGKILL.
_QUICK_STOP_GRACE_S = 5.0
# Past its drain deadline a replica's streams end now: an engine's server waits
# for open streams after SIGTERM (uvicorn's graceful shutdown), so it gets only
# this long before SIGKILL, and the gateway sends each client the error event.
_OVERDUE_STOP_GRACE_S = 1.0
# An idle drained replica: vLLM frees its GPU memory and exits within seconds.
_IDLE_STOP_GRACE_S = 30.0


class NodeAgent:
    """Reconcile and beat for one node; ``tick()`` is one pass, ``run()`` loops."""

    def __init__(
        self,
        *,
        node: str,
        region: str,
        actuator: Actuator,
        spec_for: Callable[[Replica, int], ReplicaSpec],
        warm_pool: WarmPool,
        gpus: int,
        host: str = "127.0.0.1",
        ports: tuple[int, int] = (8001, 8099),
        sink: BeatSink | None = None,
        http: httpx.Client | None = None,
        start_timeout_s: float = 120.0,
        drain_timeout_s: float | None = None,
        drain_settle_s: float | None = None,
        scrape_timeout_s: float = 0.8,
        health_timeout_s: float = 5.0,
        scrape_grace_s: float = 10.0,
        stall_after_s: float | None = None,
        db_every_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.region = region
        self.actuator = actuator
        self.spec_for = spec_for
        self.warm_pool = warm_pool
        self.gpus = gpus
        self.host = host
        self.ports = PortAllocator(host, *ports)
        self.sink = sink
        self.http = http or httpx.Client(timeout=httpx.Timeout(1.0, connect=0.5))
        self.start_timeout_s = start_timeout_s
        self.drain_timeout_s = (
            settings.PLATFORM_DRAIN_TIMEOUT_S
            if drain_timeout_s is None
            else drain_timeout_s
        )
        # Gateways read beats once a second through Redis (or the database's in
        # their snapshot): a drained replica stays the missed-beat window, so no
        # gateway still sends it a new request after it stopped. One that does
        # anyway (the database path is slower) fails before its first token and
        # is retried on another replica, unseen by the client.
        self.drain_settle_s = (
            settings.PLATFORM_HEARTBEAT_S * settings.PLATFORM_MISSED_BEATS
            if drain_settle_s is None
            else drain_settle_s
        )
        self.scrape_timeout_s = scrape_timeout_s
        self.health_timeout_s = health_timeout_s
        self.scrape_grace_s = scrape_grace_s
        self.stall_after_s = (
            settings.PLATFORM_STALL_AFTER_S if stall_after_s is None else stall_after_s
        )
        self.clock = clock
        self.db_every_s = (
            settings.PLATFORM_HEARTBEAT_DB_S if db_every_s is None else db_every_s
        )
        self._db_written_at = float("-inf")
        self._node_written_at = float("-inf")
        self._warm_written: frozenset[int] | None = None
        self.running: dict[str, _Running] = {}
        # By replica URL: the last successful scrape and when it was taken, and
        # scrapes still running.
        self._last_stats: dict[str, tuple[EngineStats, float]] = {}
        # The beats of the last pass that reached the database, for beating to
        # Redis alone while it is unreachable (``_beat_without_database``).
        self._last_beats: dict[str, ReplicaBeat] = {}
        self._is_database_down = False
        # By replica URL: what its fresh scrapes showed of its engine's progress.
        self._progress: dict[str, Progress] = {}
        self._scraping: dict[str, Future[EngineStats | None]] = {}
        # The pass and the beat loop (``run``) both scrape.
        self._scrape_lock = threading.Lock()
        self._scrapers = ThreadPoolExecutor(
            max_workers=16, thread_name_prefix="agent-scrape"
        )
        self._stoppers = ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="agent-stop"
        )

    # -- the loop ----------------------------------------------------------------------

    def run(self, stop: threading.Event, *, beat_s: float | None = None) -> None:
        """Beat every ``beat_s`` until ``stop`` is set, then stop every replica.

        The pass that reads and writes the database (``step``) runs in a thread of
        its own. A pass that holds past its beat (the database slow, refusing or
        blackholed: a query can wait seconds for a pooled connection, or minutes on
        a dead TCP peer) does not hold the beats: this loop beats from what the
        agent last knew (``_beat_from_last_known``) each beat until the pass ends.
        Gateways route by these beats, so serving never waits on the database.
        """
        beat_s = beat_s or settings.PLATFORM_HEARTBEAT_S
        self.forget_previous_life()
        ticker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-tick")
        current: Future[None] | None = None
        next_beat = self.clock()
        is_behind = False
        try:
            while not stop.is_set():
                if current is None or current.done():
                    current = ticker.submit(self._pass, timezone.now(), beat_s)
                next_beat += beat_s
                wait([current], timeout=max(0.0, next_beat - self.clock()))
                if not current.done():
                    if not is_behind:
                        is_behind = True
                        logger.warning(
                            "agent pass on node %s holds past its beat (%.2f s); "
                            "beating from what it last knew",
                            self.node,
                            beat_s,
                        )
                    self._beat_from_last_known()
                elif is_behind:
                    is_behind = False
                    logger.info("agent pass on node %s caught up", self.node)
                stop.wait(max(0.0, next_beat - self.clock()))
                if self.clock() - next_beat > beat_s:
                    next_beat = self.clock()  # fell a whole beat behind: no burst
        finally:
            # The pass in flight ends before the replicas are stopped (it may be
            # starting one); one blocked on a dead database is left to its thread.
            if current is not None:
                wait([current], timeout=_PASS_END_WAIT_S)
            ticker.shutdown(wait=False, cancel_futures=True)
            self.shutdown()

    def _pass(self, now: datetime, beat_s: float) -> None:
        """One ``step`` in the ticker thread, its connections given back after."""
        started = self.clock()
        try:
            self.step(now=now)
        finally:
            close_old_connections()
        took_s = self.clock() - started
        if took_s > beat_s:
            logger.warning("agent pass took %.2f s (beat %.2f s)", took_s, beat_s)

    def forget_previous_life(self, *, grace_s: float = 10.0) -> None:
        """Stop the replicas an agent of this node that died left running, and mark
        replicas of this node that no process of ours runs as gone.

        Their rows are gone (or soon reaped) and the reconcile starts their
        replacements: left running, they would hold their GPUs and ports for
        good, seen by no one. Their ports are probed before reuse.
        """
        self.actuator.stop_leftovers(keep=list(self.running), grace_s=grace_s)
        stale = Replica.objects.live().filter(node=self.node, region=self.region)
        for replica_id in stale.exclude(replica_id__in=list(self.running)).values_list(
            "replica_id", flat=True
        ):
            services.set_replica_state(
                replica_id, expected=_LIVE_STATES, state=ReplicaState.GONE
            )

    def shutdown(self, *, grace_s: float = 10.0) -> None:
        """Stop every replica this agent started, remove their rows and the node's."""
        for replica_id in list(self.running):
            self._stop_later(replica_id, grace_s=grace_s)
        for running in list(self.running.values()):
            if running.stopping is not None:
                running.stopping.exception()  # waits; stop is bounded by its grace
        self._finish_stops()
        services.forget_node(node=self.node, region=self.region)

    def tick(self, *, now: datetime) -> None:
        """One pass: warm pool, reconcile pools, advance replicas, publish beats."""
        self._finish_stops()
        versions = services.pool_versions(region=self.region)
        # One query for all their region rows, however many versions.
        prefetch_related_objects(versions, "regions")
        refused = self.warm_pool.hold(
            weights_ref(version, self.region) for version in versions
        )
        gpus_free = self.gpus - self._gpus_in_use()
        created, drained = services.reconcile_pools(
            region=self.region,
            node=self.node,
            gpus_free=gpus_free,
            allocate_port=self.ports,
            host=self.host,
            now=now,
            skip_version_ids=refused,
        )
        for replica in created:
            logger.info("replica %s planned on %s", replica.replica_id, self.node)
        for replica_id in drained:
            logger.info("replica %s marked draining", replica_id)
        mine = {
            r.replica_id: r
            for r in Replica.objects.filter(node=self.node, region=self.region)
            .select_related("version")
            .prefetch_related("version__regions")  # for weights_ref, in one query
        }
        scraped = self._scrape_all(
            [
                r.url
                for r in mine.values()
                if r.replica_id in self.running
                and self.running[r.replica_id].stopping is None
                and r.state in _SCRAPED_STATES
            ]
        )
        beats: list[ReplicaBeat] = []
        for replica in mine.values():
            beat = self._advance(replica, scraped)
            if beat is not None:
                beats.append(beat)
        # Processes whose rows were deleted elsewhere (an operator in the console).
        for replica_id in set(self.running) - set(mine):
            self._stop_later(replica_id, grace_s=_QUICK_STOP_GRACE_S)
        # Redis first: gateways route by these, and the database writes below may
        # wait (the beat loop covers a pass that holds, ``run``).
        self._last_beats = {beat.replica_id: beat for beat in beats}
        self._publish(beats)
        # The database hears beats at its own (possibly slower) rate; the small
        # allowance keeps a 1 s schedule from skipping every other beat.
        due_s = self.db_every_s * 0.95
        if beats and self.clock() - self._db_written_at >= due_s:
            services.record_heartbeats(beats, now=now)
            self._db_written_at = self.clock()
        if self.clock() - self._node_written_at >= due_s:
            warm = self.warm_pool.warm_version_ids()
            is_changed = warm != self._warm_written
            _, is_new = services.record_node_beat(
                node=self.node,
                region=self.region,
                gpus=self.gpus,
                now=now,
                warm_version_ids=warm if is_changed else None,
            )
            # A row created anew (deleted in the console) learns them next beat.
            self._warm_written = None if is_new and not is_changed else warm
            self._node_written_at = self.clock()

    def step(self, *, now: datetime) -> None:
        """Run one ``tick``; with the database unreachable, beat to Redis alone."""
        try:
            self.tick(now=now)
        except Exception as exc:
            # One bad pass (database restarting, a replica answering garbage) must
            # not take the node's other replicas down.
            close_old_connections()
            if is_database_unavailable(exc):
                self._beat_without_database(exc)
            else:
                logger.exception("agent tick failed on node %s", self.node)
        else:
            if self._is_database_down:
                self._is_database_down = False
                logger.info("database back; node %s reconciles", self.node)

    def _beat_without_database(self, exc: BaseException) -> None:
        """The database refused the pass: beat to Redis from what was last known."""
        if not self._is_database_down:
            self._is_database_down = True
            logger.warning(
                "database unreachable (%s); node %s beats to Redis only",
                type(exc).__name__,
                self.node,
            )
        self._beat_from_last_known()

    def _beat_from_last_known(self) -> None:
        """Beat to Redis for the replicas last seen serving, without the database.

        Gateways route by the Redis beats; without them every replica would look
        silent after the missed-beat window and serving would stop with the control
        plane. Nothing is reconciled meanwhile (no starts, drains or state changes):
        the replicas last seen serving (or stalled) and still running beat on with
        fresh scrapes, and the next pass that reaches the database takes over. Safe
        beside a pass running in the ticker thread: it reads the pass's last beats
        and the running processes, and its scrapes share the pass's (one lock).
        """
        if self.sink is None:
            return
        last = self._last_beats
        running = dict(self.running)
        alive = [
            beat
            for replica_id, beat in last.items()
            if beat.state in (ReplicaState.SERVING, ReplicaState.STALLED)
            and (process := running.get(replica_id)) is not None
            and process.stopping is None
            and self.actuator.is_running(process.handle)
        ]
        scraped = self._scrape_all([beat.url for beat in alive], forget_others=False)
        beats = []
        for beat in alive:
            stats = scraped.get(beat.url)
            if stats is None:
                # No answer: no beat, so that gateways stop routing to it after
                # the missed-beat window, as they would with the database up.
                continue
            beats.append(replace(beat, **beat_load(stats), beat_at=time.time()))
        self._publish(beats)

    def _publish(self, beats: list[ReplicaBeat]) -> None:
        if not beats or self.sink is None:
            return
        try:
            self.sink.publish(beats)
        except Exception:
            logger.warning("publishing %d beats failed", len(beats), exc_info=True)

    # -- one replica -------------------------------------------------------------------

    def _advance(
        self, replica: Replica, scraped: Mapping[str, EngineStats | None]
    ) -> ReplicaBeat | None:
        state = replica.state
        running = self.running.get(replica.replica_id)
        if running is not None and running.stopping is not None:
            return None  # stopping in the background; removed once it has exited
        if state == ReplicaState.GONE:
            # Reaped (it stopped beating) or left over from an earlier agent.
            if running is not None:
                self._stop_later(replica.replica_id, grace_s=_QUICK_STOP_GRACE_S)
            else:
                services.remove_replica(replica.replica_id)
            return None
        if state == ReplicaState.STARTING and running is None:
            return self._start_when_warm(replica)
        if running is None:
            if state == ReplicaState.DRAINING:
                # Cancelled before its process started: nothing to drain.
                services.remove_replica(replica.replica_id)
            # A row in a later state with no process of ours: the process is gone.
            return None
        if not self.actuator.is_running(running.handle):
            logger.warning("replica %s process exited", replica.replica_id)
            self.ports.release(running.port)
            self.ports.release(running.kv_events_port)
            del self.running[replica.replica_id]
            self._last_stats.pop(replica.url, None)
            self._progress.pop(replica.url, None)
            return None
        if state == ReplicaState.DRAINING:
            if running.drain_started_at is None:
                running.drain_started_at = self.clock()
            if not running.has_served:
                # Cancelled while loading: it never took a request.
                self._stop_later(replica.replica_id, grace_s=_QUICK_STOP_GRACE_S)
                return None
        if state == ReplicaState.LOADING:
            if self._healthy(replica.url):
                if not services.set_replica_state(
                    replica.replica_id,
                    expected=[ReplicaState.LOADING],
                    state=ReplicaState.SERVING,
                ):
                    return None  # cancelled meanwhile: the next tick stops it
                state = ReplicaState.SERVING
            elif self.clock() - running.started_at > self.start_timeout_s:
                logger.error("replica %s did not become healthy", replica.replica_id)
                self._stop_later(replica.replica_id, grace_s=_QUICK_STOP_GRACE_S)
                return None
            else:
                # Loading takes minutes on a GPU (seed: cold start); the agent vouches
                # for the live process so the reaper does not take it for dead.
                return self._beat(replica, state, None)
        if state in (ReplicaState.SERVING, ReplicaState.STALLED):
            running.has_served = True
        if replica.url in scraped:
            stats = scraped[replica.url]
        else:
            stats = self._scrape(replica.url)
        fresh = stats is not None
        if stats is not None:
            self._last_stats[replica.url] = (stats, self.clock())
            if state in (ReplicaState.SERVING, ReplicaState.STALLED):
                state = self._judge_progress(replica, state, stats)
        else:
            stats = self._recent_stats(replica.url)
        if state == ReplicaState.DRAINING and running.drain_started_at is not None:
            # Still beating as "draining": routers see it and send nothing new.
            draining_s = self.clock() - running.drain_started_at
            idle = (
                fresh
                and stats is not None
                and (stats.num_requests_running + stats.num_requests_waiting == 0)
            )
            if idle and draining_s >= self.drain_settle_s:
                logger.info(
                    "replica %s drained in %.1f s", replica.replica_id, draining_s
                )
                self._stop_later(replica.replica_id, grace_s=_IDLE_STOP_GRACE_S)
                return None
            if draining_s >= self.drain_timeout_s:
                held = (
                    stats.num_requests_running + stats.num_requests_waiting
                    if stats is not None
                    else -1
                )
                # Its open streams end now; the gateway sends each client the
                # stream's explicit error event.
                logger.warning(
                    "replica %s drain deadline (%.0f s) passed with %d requests; "
                    "stopping it",
                    replica.replica_id,
                    self.drain_timeout_s,
                    held,
                )
                self._stop_later(replica.replica_id, grace_s=_OVERDUE_STOP_GRACE_S)
                return None
        if stats is None:
            # Process up but /metrics silent past the grace: a hung engine must
            # miss its beats.
            return None
        return self._beat(replica, state, stats)

    def _judge_progress(self, replica: Replica, state: str, stats: EngineStats) -> str:
        """Mark a serving replica stalled, or a stalled one serving; return its state.

        ``stats`` is a fresh scrape (a reused one would look flat).
        """
        now = self.clock()
        progress = self._progress[replica.url] = observe_progress(
            self._progress.get(replica.url), stats, now
        )
        stalled = is_stalled(progress, now, self.stall_after_s)
        if stalled == (state == ReplicaState.STALLED):
            return state
        new = ReplicaState.STALLED if stalled else ReplicaState.SERVING
        if not services.set_replica_state(
            replica.replica_id, expected=[state], state=new
        ):
            return state  # moved meanwhile (marked draining): left as it is now
        if stalled:
            logger.warning(
                "replica %s stalled: %d requests and no progress for %.1f s",
                replica.replica_id,
                stats.num_requests_running + stats.num_requests_waiting,
                self.stall_after_s,
            )
        else:
            logger.info("replica %s moves again: serving", replica.replica_id)
        return new

    def _beat(
        self, replica: Replica, state: str, stats: EngineStats | None
    ) -> ReplicaBeat:
        return ReplicaBeat(
            replica_id=replica.replica_id,
            model=replica.model_id,
            version=replica.version.version,
            region=replica.region,
            node=replica.node,
            url=replica.url,
            state=str(state),
            **beat_load(stats),
            beat_at=time.time(),
        )

    def _start_when_warm(self, replica: Replica) -> ReplicaBeat | None:
        """Start a ``starting`` replica once its weights are on local disk.

        While the warm pool pulls them, the agent beats for the replica (as
        ``starting``) so the reaper does not take it for dead; if the pull failed,
        or the region's copy of the weights is not ready (``weights_ref``), the
        replica is marked gone, and this node starts no more of its version until
        the warm pool tries again or the copy turns ready.
        """
        readiness, why = self.warm_pool.readiness(
            weights_ref(replica.version, replica.region)
        )
        if readiness == Readiness.PULLING:
            return self._beat(replica, replica.state, None)
        if readiness == Readiness.FAILED:
            logger.error(
                "replica %s refused: its weights failed: %s", replica.replica_id, why
            )
            services.set_replica_state(
                replica.replica_id,
                expected=[ReplicaState.STARTING],
                state=ReplicaState.GONE,
            )
            return None
        self._start(replica)
        return None

    def _start(self, replica: Replica) -> None:
        port = int(replica.url.rsplit(":", 1)[1])
        kv_events_port = kv_events_port_of(replica)
        self.ports.taken.add(port)
        if kv_events_port:
            self.ports.taken.add(kv_events_port)
        try:
            spec = self.spec_for(replica, port)
            handle = self.actuator.start(spec)
        except Exception:
            logger.exception("replica %s failed to start", replica.replica_id)
            self.ports.release(port)
            self.ports.release(kv_events_port)
            services.set_replica_state(
                replica.replica_id,
                expected=[ReplicaState.STARTING],
                state=ReplicaState.GONE,
            )
            return
        self.running[replica.replica_id] = _Running(
            handle=handle,
            port=port,
            kv_events_port=kv_events_port,
            started_at=self.clock(),
            gpus=replica.version.gpus_per_replica,
        )
        # If the row moved meanwhile (cancelled: draining), the next tick stops it.
        services.set_replica_state(
            replica.replica_id,
            expected=[ReplicaState.STARTING],
            state=ReplicaState.LOADING,
        )
        logger.info("replica %s started on port %d", replica.replica_id, port)

    def _stop_later(self, replica_id: str, *, grace_s: float) -> None:
        """Stop the replica's process in a thread; its row goes once it has exited."""
        running = self.running.get(replica_id)
        if running is None:
            services.remove_replica(replica_id)
            return
        if running.stopping is None:
            running.stopping = self._stoppers.submit(
                self.actuator.stop, running.handle, grace_s=grace_s
            )

    def _finish_stops(self) -> None:
        """Remove the rows (and Redis beats) of replicas whose process has exited."""
        for replica_id, running in list(self.running.items()):
            if running.stopping is None or not running.stopping.done():
                continue
            del self.running[replica_id]
            self.ports.release(running.port)
            self.ports.release(running.kv_events_port)
            error = running.stopping.exception()
            if error is not None:
                logger.error("stopping replica %s failed: %r", replica_id, error)
            if self.sink is not None:
                try:
                    self.sink.forget(replica_id, self.region)
                except Exception:
                    logger.warning(
                        "could not forget beat of %s", replica_id, exc_info=True
                    )
            services.remove_replica(replica_id)
            logger.info("replica %s stopped and removed", replica_id)

    def _gpus_in_use(self) -> int:
        """GPUs held by this node's processes, and by its rows not yet started.

        A process still exiting holds its GPUs whatever its row says (a reaped
        replica's row is gone while its engine frees memory).
        """
        rows = Replica.objects.live().filter(node=self.node, region=self.region)
        planned = sum(
            r.version.gpus_per_replica
            for r in rows.select_related("version")
            if r.replica_id not in self.running
        )
        return planned + sum(r.gpus for r in self.running.values())

    def _healthy(self, url: str) -> bool:
        # SGLang's /health generates one token before it answers (about 1 s on
        # this CPU), so the probe waits longer than the client's 1 s default.
        try:
            response = self.http.get(f"{url}/health", timeout=self.health_timeout_s)
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    def _scrape_all(
        self, urls: list[str], *, forget_others: bool = True
    ) -> dict[str, EngineStats | None]:
        """Scrape every URL at once; return each one's stats (None: no answer yet).

        Waits at most ``scrape_timeout_s``; a scrape still running is kept for the
        next tick instead of being started again. ``forget_others``: drop what is
        kept of replicas not in ``urls`` (a pass's full list; not the beat loop's).
        """
        with self._scrape_lock:
            futures = {}
            for url in urls:
                future = self._scraping.get(url)
                if future is None:
                    future = self._scraping[url] = self._scrapers.submit(
                        self._scrape, url
                    )
                futures[url] = future
            done, _ = wait(futures.values(), timeout=self.scrape_timeout_s)
            stats: dict[str, EngineStats | None] = {}
            for url, future in futures.items():
                if future in done:
                    del self._scraping[url]
                    stats[url] = future.result()
                else:
                    stats[url] = None
            if forget_others:
                for url in set(self._last_stats) - set(urls):
                    # Replicas gone or no longer scraped (stopped, loading again).
                    del self._last_stats[url]
                for url in set(self._progress) - set(urls):
                    del self._progress[url]
            return stats

    def _recent_stats(self, url: str) -> EngineStats | None:
        """Return the last scrape if it is younger than ``scrape_grace_s``."""
        last = self._last_stats.get(url)
        if last is None or self.clock() - last[1] > self.scrape_grace_s:
            return None
        return last[0]

    def _scrape(self, url: str) -> EngineStats | None:
        return scrape_engine(self.http, url)


_LIVE_STATES = [
    ReplicaState.STARTING,
    ReplicaState.LOADING,
    ReplicaState.SERVING,
    ReplicaState.STALLED,
    ReplicaState.DRAINING,
]
# States whose replicas run an engine the agent scrapes every beat.
_SCRAPED_STATES = (ReplicaState.SERVING, ReplicaState.STALLED, ReplicaState.DRAINING)


def weights_ref(version: ModelVersion, region: str) -> WeightsRef:
    """Return what the warm pool needs to know of a version's weights in ``region``.

    The weights come from the region's ready copy (the version's ``VersionRegion``
    row, written by the weights gate). A copy that is still copying or failed, or
    none in ``region`` while other regions have one, makes a ref with a
    ``refusal``: the version does not start here. A version with no region rows at
    all (registered before the gates, or accepted without them) is pulled from its
    ``weights_uri``. Reads ``version.regions.all()``: prefetch it.
    """
    rows = list(version.regions.all())
    uri, refusal = version.weights_uri, ""
    if rows:
        row = next((r for r in rows if r.region == region), None)
        if row is None:
            refusal = f"{version.ref} has no copy of its weights in region {region}"
        elif row.state == RegionState.FAILED:
            refusal = (
                f"{version.ref}'s weights copy in region {region} failed: "
                f"{row.detail or 'no detail'}"
            )
        elif row.state != RegionState.READY:
            refusal = (
                f"{version.ref}'s weights copy in region {region} is not ready "
                f"({row.state})"
            )
        else:
            uri = row.uri
    return WeightsRef(
        version_id=version.pk,
        weights_uri=uri,
        weights_hash=version.weights_hash,
        refusal=refusal,
    )


def spec_builder(*, warm_pool: WarmPool) -> Callable[[Replica, int], ReplicaSpec]:
    """Return the function that turns a replica row into what its process runs.

    The weights come from ``warm_pool``: pulled to this node's cache and verified
    against the version's hash before a process starts, always for ``vllm`` and for
    simulated replicas whose weights live on a ``file://`` root (the simulator
    loads nothing, but a mismatch must stop it all the same). The agent starts a
    replica only once the warm pool has them; a tree changed on disk since it
    verified is verified again here. A mismatch raises, and the agent marks the
    replica gone instead of serving the wrong weights.
    """

    def build(replica: Replica, port: int) -> ReplicaSpec:
        version = replica.version
        weights_dir = warm_pool.local_dir(weights_ref(version, replica.region))
        return services.replica_spec(
            version,
            model_id=replica.model_id,
            replica_id=replica.replica_id,
            weights_dir=str(weights_dir) if weights_dir is not None else "",
            host=replica.url.split("://", 1)[1].rsplit(":", 1)[0],
            port=port,
            kv_events_port=kv_events_port_of(replica),
        )

    return build


def kv_events_port_of(replica: Replica) -> int:
    """Return the port of the replica's ``kv_events_url`` (0 when it has none)."""
    if not replica.kv_events_url:
        return 0
    return int(replica.kv_events_url.rsplit(":", 1)[1])
