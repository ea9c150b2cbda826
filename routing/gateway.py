"""The OpenAI-compatible gateway: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``, ``/v1/embeddings``, ``/v1/models``, ``/tokenize``, ``/healthz``.

Public surface: ``Gateway``.

A raw ASGI application (under uvicorn, behind the Channels router): the token stream
is the platform's hottest path, and every microsecond per relayed event counts
against the bare relay it is benchmarked with. It never touches the ORM: keys,
limits, aliases, canaries and replicas come from the ``SnapshotHolder``, load from
``LiveLoad``.

This module is the process's lifecycle (the upstream session, the background
loops: snapshot refresh, live-load exchange, usage flush) and the dispatch of a
request. A chat request is a pipeline of the modules beside it:
``routing.plan`` (key -> team -> body -> version -> limits -> prompt tokens, one
immutable ``ChatPlan``; a completion and a response are planned as one too, and
served by the same pipeline, as is an embeddings request: ``routing.embeddings``),
``routing.chat`` (admission, routing with retries, the
``routing.relay``, metering), with the OpenAI shapes in ``routing.responses``.
``/tokenize`` is resolved the same way and passed to a replica
(``routing.tokenize``). A batch job's key (``KeyRecord.batch``) opens only the
APIs a batch runs, chat completions and embeddings: ``/v1/models``,
``/tokenize`` and the other generation APIs answer it 403. Whatever fails, the
client gets OpenAI's error shape: an unexpected exception is logged (its type and
frames, never its message, which may quote the request) and answered as a JSON
500, or as an error event once a stream has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import random
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from config.asgi_io import CHUNKED_WRITE, Receive, Scope, Send, wait_disconnect
from metering import metrics
from routing.chat import BackgroundTasks, ChatService
from routing.domain.hosts import HostPolicy
from routing.domain.readiness import Readiness, judge_readiness
from routing.domain.snapshot import ConfigSnapshot, KeyRecord
from routing.embeddings import longest_input, plan_embedding
from routing.failover import RedisFailover
from routing.intake import authenticate, read_json
from routing.key_uses import KeyUses
from routing.live import LiveLoad
from routing.plan import (
    ChatPlan,
    GatewaySettings,
    plan_chat,
    plan_completion,
    plan_response,
    team_limit,
)
from routing.region_limits import RegionLimits
from routing.relay import EVENT_END
from routing.responses import ClientGone, GatewayError, respond
from routing.snapshots import SnapshotHolder
from routing.tokenize import TokenizeProxy, plan_tokenize
from routing.traces import TRACING_OFF, Tracing
from routing.upstream import Upstream

logger = logging.getLogger(__name__)

__all__ = ["Gateway"]

_GC_THRESHOLDS = (50_000, 20, 10)
# Host headers already judged, so a request pays one dict lookup; cleared when
# full, so a client sending a new Host every time cannot grow it without bound.
_HOST_MEMO_SIZE = 1024
# The planners of the APIs a batch runs: a batch job's key opens these only.
_BATCH_PLANNERS = (plan_chat, plan_embedding)


class Gateway:
    """The gateway of one process: what it serves from, and the loops that feed it.

    Everything it holds is given at construction; ``start`` opens the upstream
    session and starts the loops (the first request starts them too, when the
    server sends no lifespan events), ``stop`` ends them and flushes usage.
    """

    def __init__(
        self,
        *,
        settings: GatewaySettings,
        snapshots: SnapshotHolder,
        live: LiveLoad,
        chat: ChatService,
        upstream: Upstream,
        background: BackgroundTasks,
        snapshot_refresh_s: float = 2.0,
        exchange_s: float = 1.0,
        flush_usage: Callable[[], Awaitable[None]] | None = None,
        flush_usage_s: float = 10.0,
        failover: RedisFailover | None = None,
        hosts: HostPolicy,
        key_uses: KeyUses | None = None,
        key_uses_flush_s: float = 60.0,
        max_snapshot_age_s: float | None = None,
        region_limits: RegionLimits | None = None,
        tracing: Tracing = TRACING_OFF,
    ) -> None:
        self.settings = settings
        self.tracing = tracing
        self.region_limits = region_limits
        # Older than this while the control plane answers, the refresh loop is
        # stuck: /healthz takes the region out.
        self.max_snapshot_age_s = (
            max(10.0, 5 * snapshot_refresh_s)
            if max_snapshot_age_s is None
            else max_snapshot_age_s
        )
        self.snapshots = snapshots
        self.live = live
        self.chat = chat
        self.upstream = upstream
        self.background = background
        self.snapshot_refresh_s = snapshot_refresh_s
        self.exchange_s = exchange_s
        self.flush_usage = flush_usage
        self.flush_usage_s = flush_usage_s
        self.failover = failover
        self.hosts = hosts
        self.key_uses = key_uses
        self.key_uses_flush_s = key_uses_flush_s
        self._host_verdicts: dict[bytes, bool] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._rng = random.Random()
        self.tokenize = TokenizeProxy(
            upstream=upstream, live=live, connect_timeout_s=settings.connect_timeout_s
        )

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Open the upstream pool, load the first snapshot, start the loops.

        Never fails for want of the control plane: without a first snapshot the
        gateway answers 503 and ``/healthz`` says why until a refresh succeeds.
        """
        if self.upstream.is_open:
            return
        await self.upstream.open()
        await self.snapshots.refresh()
        await self._exchange_once()
        self._tasks = [
            asyncio.create_task(
                self._every(self.snapshot_refresh_s, self.snapshots.refresh)
            ),
            asyncio.create_task(self._every(self.exchange_s, self._exchange_once)),
        ]
        if self.flush_usage is not None:
            self._tasks.append(
                asyncio.create_task(self._every(self.flush_usage_s, self.flush_usage))
            )
        if self.key_uses is not None:
            self._tasks.append(
                asyncio.create_task(
                    self._every(self.key_uses_flush_s, self.key_uses.flush)
                )
            )
        # Django, the app registry and the first snapshot are long-lived: move them
        # out of the collector's generations so relaying tokens does not rescan them.
        gc.collect()
        gc.freeze()
        # Every relayed chunk allocates a few containers, and with Python's default
        # thresholds (700, 10, 10) the collector ran over the streams' live objects
        # (calls, tasks, responses) often enough to take about 10% of a gateway at
        # 1,000 streams. Objects here are freed by reference counting; the collector
        # is only for cycles, which can wait for a larger young generation.
        gc.set_threshold(*_GC_THRESHOLDS)

    async def stop(self) -> None:
        """Stop background loops, flush usage, close the upstream pool."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.background.drain()
        await self.chat.kv_events.close()
        await self.snapshots.prompt_counters.close()
        if self.flush_usage is not None:
            with contextlib.suppress(Exception):
                await self.flush_usage()
        if self.key_uses is not None:
            with contextlib.suppress(Exception):
                await self.key_uses.flush()
        if self.failover is not None:
            await self.failover.stop()
        with contextlib.suppress(Exception):
            await self.live.leave()
        await self.upstream.close()

    async def _exchange_once(self) -> None:
        """Exchange live load; it is also the probe of Redis for the failover."""
        was_up = self.live.is_redis_up
        try:
            await self.live.exchange()
        except Exception as exc:
            # Once per outage: the exchange fails every second until Redis answers.
            if was_up:
                logger.warning("live load exchange failed: %s", type(exc).__name__)
            if self.failover is not None:
                self.failover.fall_back(exc)
        else:
            if self.failover is not None:
                await self.failover.restore()
            if self.region_limits is not None:
                try:
                    await self.region_limits.exchange()
                except Exception as exc:
                    logger.warning("limit shares exchange failed: %s", exc)
        self._publish_pool_gauges()
        self._readiness()  # the gauge, between the balancer's checks
        # Subscribe to the KV events of replicas that joined; drop those that left.
        self.chat.kv_events.sync(self.snapshots.current)

    def _publish_pool_gauges(self) -> None:
        """Set each pool's tokens in flight and queue depth (once a second).

        A pool is this region's while the snapshot has a replica of it or a pool
        row that wants one (0 and 0 without replicas). Any other pool with series
        here has them removed, gauges and counters, so none stays at its last
        value: one that left (removed, released once nothing routes to its
        version, its last replica gone), and one the snapshot never held (a
        request pinned to a version with no pool in this region, answered 503).
        """
        snapshot = self.snapshots.current
        if snapshot is None:
            return
        pools: dict[tuple[str, str], list[int]] = {
            pool: [0, 0] for pool in snapshot.pools
        }
        for replica in snapshot.replicas:
            totals = pools.setdefault((replica.model, replica.version), [0, 0])
            totals[0] += self.live.tokens_in_flight(replica.replica_id)
            beat = self.live.beats.get(replica.replica_id)
            totals[1] += beat.queue_depth if beat else replica.queue_depth
        indexes = self.chat.kv_events.indexes
        for (model, version), (tokens_in_flight, queue_depth) in pools.items():
            index = indexes.get((model, version))
            metrics.set_pool_load(
                model=model,
                version=version,
                region=self.settings.region,
                tokens_in_flight=tokens_in_flight,
                queue_depth=queue_depth,
                index_blocks=index.blocks() if index is not None else 0,
            )
        region = self.settings.region
        for model, version in metrics.pools_with_series(region) - pools.keys():
            metrics.forget_pool(model, version, region)

    async def _every(
        self, interval_s: float, job: Callable[[], Awaitable[None]]
    ) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await job()
            except Exception:
                logger.exception("background job %s failed", job)

    # -- ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path = scope["path"]
        method = scope["method"]
        try:
            if not self.upstream.is_open:
                await self.start()
            if path.startswith("/v1/") or path == "/tokenize":
                self._check_host(scope)
            if path == "/v1/chat/completions":
                if method != "POST":
                    raise GatewayError(
                        405,
                        "use POST for /v1/chat/completions",
                        headers={"allow": "POST"},
                    )
                await self._chat(scope, receive, send, planner=plan_chat)
            elif path == "/v1/completions":
                if method != "POST":
                    raise GatewayError(
                        405,
                        "use POST for /v1/completions",
                        headers={"allow": "POST"},
                    )
                await self._chat(scope, receive, send, planner=plan_completion)
            elif path == "/v1/responses":
                if method != "POST":
                    raise GatewayError(
                        405,
                        "use POST for /v1/responses",
                        headers={"allow": "POST"},
                    )
                await self._chat(scope, receive, send, planner=plan_response)
            elif path == "/v1/embeddings":
                if method != "POST":
                    raise GatewayError(
                        405,
                        "use POST for /v1/embeddings",
                        headers={"allow": "POST"},
                    )
                await self._chat(scope, receive, send, planner=plan_embedding)
            elif path == "/v1/models":
                if method != "GET":
                    raise GatewayError(
                        405, "use GET for /v1/models", headers={"allow": "GET"}
                    )
                await self._models(scope, send)
            elif path == "/tokenize":
                if method != "POST":
                    raise GatewayError(
                        405, "use POST for /tokenize", headers={"allow": "POST"}
                    )
                await self._tokenize(scope, receive, send)
            elif path == "/healthz":
                await self._health(send)
            else:
                raise GatewayError(404, f"no such endpoint: {path}")
        except GatewayError as exc:
            await respond(send, exc.status, exc.body(), headers=exc.headers)
        except ClientGone:
            return
        except Exception as exc:
            # The last resort, for a bug: never the server's plain-text 500.
            logger.error(
                "unhandled %s on %s %s\n%s",
                type(exc).__name__,
                method,
                path,
                "".join(traceback.format_tb(exc.__traceback__)),
            )
            await _answer_internal_error(send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _health(self, send: Send) -> None:
        """Answer whether this region can serve (``routing.domain.readiness``).

        200 when it can, 503 with the reasons when it cannot: the global load
        balancer takes the region out on a 503. Degraded (a stale snapshot while
        the control plane is down) still serves, with 200.
        """
        holder = self.snapshots
        age = holder.age_s()
        failover = self.failover
        readiness, redis, serving = self._readiness()
        is_degraded = not holder.control_plane_up or (
            failover is not None and failover.is_degraded
        )
        if not readiness.ready:
            status = "unavailable"
        else:
            status = "degraded" if is_degraded else "ok"
        body: dict[str, object] = {
            "status": status,
            "ready": readiness.ready,
            "reasons": list(readiness.reasons),
            "region": self.settings.region,
            "control_plane": "up" if holder.control_plane_up else "unreachable",
            "snapshot": readiness.snapshot,
            "snapshot_age_s": None if age is None else round(age, 3),
            "snapshot_source": holder.source,  # "database", "disk" or None
            "serving_replicas": serving,
            "redis": redis,
        }
        if self.live.redis is None:
            body.update(limits="embedded", usage="embedded")
        else:
            body["gateways"] = self.live.gateways_seen  # in the region, last seen
        if failover is not None:
            body.update(failover.health())
        code = 200 if readiness.ready else 503
        await respond(send, code, json.dumps(body).encode())

    def _readiness(self) -> tuple[Readiness, str, dict[str, int]]:
        """Judge the region (and set the gauge); return the verdict, Redis's state
        and the serving replicas by pool."""
        if self.live.redis is None:
            redis = "unused"
        else:
            redis = "up" if self.live.is_redis_up else "unreachable"
        serving = self._serving_by_pool()
        readiness = judge_readiness(
            has_snapshot=self.snapshots.current is not None,
            snapshot_age_s=self.snapshots.age_s(),
            control_plane_up=self.snapshots.control_plane_up,
            max_snapshot_age_s=self.max_snapshot_age_s,
            redis=redis,
            serving=serving,
        )
        metrics.set_region_ready(ready=readiness.ready)
        return readiness, redis, serving

    def _serving_by_pool(self) -> dict[str, int]:
        """Count, per pool of the region that wants replicas, those a request may
        go to now (the router's own eligibility: ``LiveLoad.nodes``)."""
        snapshot = self.snapshots.current
        if snapshot is None:
            return {}
        now = time.monotonic()
        return {
            f"{model}@{version}": len(self.live.nodes(snapshot, model, version, now))
            for model, version in sorted(snapshot.pools)
        }

    def _check_host(self, scope: Scope) -> None:
        """Refuse a Host that ALLOWED_HOSTS does not allow, as Django does (400).

        Without a Host header the server's own address stands in, as in Django.
        """
        host = b""
        for name, value in scope.get("headers", ()):
            if name == b"host":
                # Django joins repeated headers with commas: never a valid host.
                host = value if not host else host + b"," + value
        if not host:
            server = scope.get("server") or ("", None)
            host = f"{server[0]}:{server[1]}".encode() if server[1] else b""
        verdict = self._host_verdicts.get(host)
        if verdict is None:
            verdict = self.hosts.allows(host.decode("latin-1"))
            if len(self._host_verdicts) >= _HOST_MEMO_SIZE:
                self._host_verdicts.clear()
            self._host_verdicts[host] = verdict
        if not verdict:
            raise GatewayError(
                400,
                "the Host header names a host this server does not serve "
                "(PLATFORM_ALLOWED_HOSTS)",
                code="invalid_host",
            )

    def _key(self, scope: Scope, snapshot: ConfigSnapshot) -> KeyRecord:
        """Return the request's key, noting its use."""
        key = authenticate(scope, snapshot)
        if self.key_uses is not None:
            self.key_uses.note(key.key_id)
        return key

    def _team(self, scope: Scope, snapshot: ConfigSnapshot) -> str:
        """Return the team of the request's key; a batch job's key is refused (403):
        it opens only the APIs a batch runs."""
        return self._key_of_team(scope, snapshot).team

    def _key_of_team(self, scope: Scope, snapshot: ConfigSnapshot) -> KeyRecord:
        """Return the request's key, a team's own (a batch job's is refused: 403)."""
        key = self._key(scope, snapshot)
        if key.batch:
            raise GatewayError(
                403,
                "a batch job's key opens only /v1/chat/completions and /v1/embeddings",
                code="batch_key_not_allowed",
                error_type="permission_error",
            )
        return key

    def _snapshot(self) -> ConfigSnapshot:
        snapshot = self.snapshots.current
        if snapshot is None:
            raise GatewayError(
                503,
                "the gateway has no configuration yet; retry shortly",
                headers={"retry-after": "2"},
            )
        return snapshot

    async def _models(self, scope: Scope, send: Send) -> None:
        """List the live models the team may call, OpenAI's Model objects with
        the platform's fields beside: the live version, the kind (which API the
        model answers) and, for an embedding model, its vector size and the most
        tokens one input may take."""
        snapshot = self._snapshot()
        team = self._team(scope, snapshot)
        data: list[dict[str, object]] = []
        for name, record in sorted(snapshot.models.items()):
            live = record.live_version
            if live is None or not team_limit(snapshot, self.settings, team, name):
                continue
            entry: dict[str, object] = {
                "id": name,
                "object": "model",
                "created": int(snapshot.built_at),
                "owned_by": "platform",
                "live_version": live,
                "kind": record.kind,
            }
            if record.is_embedding:
                entry["dimensions"] = record.dimensions
                entry["max_input_tokens"] = longest_input(
                    record, snapshot.versions.get((name, live))
                )
            data.append(entry)
        await respond(send, 200, json.dumps({"object": "list", "data": data}).encode())

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        snapshot = self._snapshot()
        headers = dict(scope.get("headers", ()))
        with self.tracing.start_request(
            scope["method"], scope["path"], headers
        ) as trace:
            team = self._team(scope, snapshot)
            body = await read_json(receive, headers, self.settings.max_body_bytes)
            plan = plan_tokenize(
                snapshot=snapshot,
                settings=self.settings,
                team=team,
                headers=headers,
                body=body,
                rng=self._rng,
            )
            await self.tokenize.serve(plan, snapshot, send, trace)

    async def _chat(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        planner: Callable[..., Awaitable[ChatPlan]],
    ) -> None:
        """Plan a request (``planner``: chat, completion, responses or
        embeddings) and serve it; a batch job's key opens only the APIs a batch runs (chat
        completions and embeddings)."""
        started_at = time.monotonic()
        headers = dict(scope.get("headers", ()))
        trace = self.tracing.start_request(scope["method"], scope["path"], headers)
        with trace:  # the root span, ended with the answer's status
            snapshot = self._snapshot()
            with trace.span("gateway.authenticate"):
                key = (
                    self._key(scope, snapshot)
                    if planner in _BATCH_PLANNERS
                    else self._key_of_team(scope, snapshot)
                )
            body = await read_json(receive, headers, self.settings.max_body_bytes)
            # From here on a client that goes away cancels this task (queued
            # admission included); reads from the engine need no per-chunk race
            # with the client.
            task = asyncio.current_task()
            assert task is not None
            watch = _DisconnectWatch(task)
            watcher = asyncio.ensure_future(wait_disconnect(receive))
            watcher.add_done_callback(watch.on_disconnect)
            try:
                with trace.span("gateway.plan"):
                    plan = await planner(
                        snapshot=snapshot,
                        settings=self.settings,
                        counters=self.snapshots.prompt_counters,
                        team=key.team,
                        headers=headers,
                        body=body,
                        started_at=started_at,
                        rng=self._rng,
                        batch_key=key.batch,
                    )
                await self.chat.serve(
                    plan,
                    snapshot,
                    send,
                    before_last_send=watch.finish,
                    write_frames=scope.get("extensions", {}).get(CHUNKED_WRITE),
                    trace=trace,
                )
            except asyncio.CancelledError:
                if not watch.fired:
                    raise
                task.uncancel()
                raise ClientGone from None
            finally:
                watch.finish()
                watcher.cancel()


async def _answer_internal_error(send: Send) -> None:
    """Answer a JSON 500; if the answer had started (a stream), end it with the
    error as its last event instead."""
    error = GatewayError(
        500, "internal error; the failure was logged", code="internal_error"
    ).body()
    try:
        await respond(send, 500, error)
    except Exception:
        with contextlib.suppress(Exception):  # the client may be gone as well
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + error + EVENT_END + b"data: [DONE]" + EVENT_END,
                    "more_body": False,
                }
            )


class _DisconnectWatch:
    """Cancel a request's task when its client disconnects, until it has finished."""

    __slots__ = ("finished", "fired", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.finished = False
        self.fired = False

    def finish(self) -> None:
        """Stop watching: the answer is complete, or is being completed."""
        self.finished = True

    def on_disconnect(self, watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled() or self.finished:
            return
        self.fired = True
        self.task.cancel()
