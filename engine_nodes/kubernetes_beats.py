"""Register and beat for the replicas of pools that run as Kubernetes Deployments.

On a node, the agent registers each replica it starts, scrapes its ``/metrics``
and beats; on Kubernetes no agent runs, so ``KubernetesBeats`` does the same from
the actuator's process. Every beat it lists each pool's pods by the Deployment's
selector (``pods`` ``list``: no ``watch``), writes the rows they call for
(``engine_nodes.domain.k8s_pods``, through ``services.apply_pod_replicas``),
scrapes every serving or draining pod at once (each scrape bounded by
``scrape_timeout_s``) and publishes the agent's beats: to Redis every beat, to
the database every ``PLATFORM_HEARTBEAT_DB_S``. A starting pod beats with no
load (the reaper leaves it; its startup probe bounds it); a pod whose
``/metrics`` does not answer in time is not beaten, so the gateways drop it
after the missed-beat window and the reaper marks it gone, as for an agent's
replica. See ``docs/kubernetes-pools.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from datetime import datetime

import httpx
from django.conf import settings
from django.db import close_old_connections, connections
from django.utils import timezone

from engine_nodes import services
from engine_nodes.agent import BeatSink
from engine_nodes.domain.beats import ReplicaBeat
from engine_nodes.domain.k8s import DeploymentTemplate
from engine_nodes.domain.k8s_pods import plan_pod_replicas
from engine_nodes.domain.liveness import ReplicaState
from engine_nodes.domain.scrape import EngineStats
from engine_nodes.kubernetes_actuator import CoreV1Like, list_pod_facts
from engine_nodes.metrics_scrape import beat_load, scrape_engine

__all__ = ["KubernetesBeats"]

logger = logging.getLogger(__name__)

_SCRAPED = (ReplicaState.SERVING, ReplicaState.DRAINING)


# How many beats' waits a scrape may run before it is given up.
_SCRAPE_DEADLINE_BEATS = 5


class KubernetesBeats:
    """List the region's pool pods, keep their replica rows, and beat for them."""

    def __init__(
        self,
        core: CoreV1Like,
        namespace: str,
        *,
        region: str,
        template: DeploymentTemplate,
        sink: BeatSink | None,
        engine_api_key: str = "",
        scrape_timeout_s: float = 0.8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self.namespace = namespace
        self.region = region
        self.template = template
        self.sink = sink
        self.scrape_timeout_s = scrape_timeout_s
        self.clock = clock
        # vLLM's /metrics takes no key; a server that guards it gets the same one.
        headers = (
            {"authorization": f"Bearer {engine_api_key}"} if engine_api_key else {}
        )
        # A beat waits scrape_timeout_s for the scrapes; one still running then
        # is left to finish (and waited on again next beat, never sent twice), so
        # its own deadline is longer: with equal ones it often ended between two
        # beats and a hung pod was asked again every beat.
        self.http = httpx.Client(
            timeout=httpx.Timeout(
                scrape_timeout_s * _SCRAPE_DEADLINE_BEATS,
                connect=min(0.5, scrape_timeout_s),
            ),
            headers=headers,
        )
        self._scrapers = ThreadPoolExecutor(
            max_workers=16, thread_name_prefix="k8s-scrape"
        )
        self._db_written_at = float("-inf")
        # By URL: scrapes still running, waited on again next beat rather than
        # started twice (a hung pod must not fill the pool with its scrapes).
        self._scraping: dict[str, Future[EngineStats | None]] = {}

    def tick(self, *, now: datetime) -> list[ReplicaBeat]:
        """List, register, scrape and beat once; return the beats published."""
        wanted: list[ReplicaBeat] = []
        for pool, spec in services.kubernetes_pool_specs(
            region=self.region, template=self.template
        ):
            plan = plan_pod_replicas(
                deployment=spec.name,
                port=spec.port,
                kv_events_port=spec.kv_events_port,
                pods=list_pod_facts(self.core, self.namespace, spec),
                rows=services.pod_replica_rows(
                    deployment=spec.name, region=self.region
                ),
            )
            states = services.apply_pod_replicas(plan, pool=pool)
            self._forget(plan.removed)
            wanted.extend(
                ReplicaBeat(
                    replica_id=r.replica_id,
                    model=pool.model_id,
                    version=pool.version.version,
                    region=self.region,
                    node=r.node,
                    url=r.url,
                    state=states[r.replica_id],
                    **beat_load(None),
                    beat_at=0.0,
                )
                for r in plan.replicas
                if states.get(r.replica_id, ReplicaState.GONE) != ReplicaState.GONE
            )
        scraped = self._scrape_all([b.url for b in wanted if b.state in _SCRAPED])
        beats = [
            _with_load(beat, scraped.get(beat.url))
            for beat in wanted
            if beat.state not in _SCRAPED or scraped.get(beat.url) is not None
        ]
        if beats and self.sink is not None:
            try:
                self.sink.publish(beats)
            except Exception:
                logger.warning("publishing %d beats failed", len(beats), exc_info=True)
        due_s = settings.PLATFORM_HEARTBEAT_DB_S * 0.9
        if beats and self.clock() - self._db_written_at >= due_s:
            services.record_heartbeats(beats, now=now)
            self._db_written_at = self.clock()
        return beats

    def run(self, stop: threading.Event, *, beat_s: float) -> None:
        """Tick every ``beat_s`` until ``stop`` is set; a failed tick is logged.

        Closes this thread's database connections when it ends.
        """
        try:
            while not stop.is_set():
                started = self.clock()
                try:
                    self.tick(now=timezone.now())
                except Exception as exc:  # the API or the database: next beat
                    logger.warning("kubernetes beats failed: %s", type(exc).__name__)
                    close_old_connections()
                stop.wait(max(0.0, beat_s - (self.clock() - started)))
        finally:
            connections.close_all()

    def close(self) -> None:
        """Stop the scrapers and the HTTP client."""
        self._scrapers.shutdown(wait=False, cancel_futures=True)
        self.http.close()

    def _scrape_all(self, urls: list[str]) -> dict[str, EngineStats | None]:
        """Scrape every URL at once, waiting at most ``scrape_timeout_s``."""
        futures = {
            url: self._scraping.get(url)
            or self._scrapers.submit(scrape_engine, self.http, url)
            for url in urls
        }
        done, _ = wait(futures.values(), timeout=self.scrape_timeout_s)
        self._scraping = {u: f for u, f in futures.items() if f not in done}
        return {
            url: future.result() if future in done else None
            for url, future in futures.items()
        }

    def _forget(self, replica_ids: tuple[str, ...]) -> None:
        if self.sink is None:
            return
        for replica_id in replica_ids:
            try:
                self.sink.forget(replica_id, self.region)
            except Exception:
                logger.warning("could not forget beat of %s", replica_id, exc_info=True)


def _with_load(beat: ReplicaBeat, stats: EngineStats | None) -> ReplicaBeat:
    return replace(beat, **beat_load(stats), beat_at=time.time())
