"""The OpenAI-compatible gateway: ``/v1/chat/completions``, ``/v1/models``, ``/healthz``.

Public surface: ``GatewaySettings``, ``Gateway``.

A raw ASGI application (under uvicorn, behind the Channels router): the token stream
is the platform's hottest path, and every microsecond per relayed event counts
against the bare relay it is benchmarked with. It never touches the ORM: keys,
limits, aliases, canaries and replicas come from an in-memory ``ConfigSnapshot``
rebuilt in the background, and load comes from ``LiveLoad``.

One request (seed steps 6-9 and 12):
1. key -> team (SHA-256 looked up in the snapshot), tier from ``x-priority``;
2. body checked, prompt tokens counted with the version's tokenizer and chat
   template (``routing.prompt_tokens``; the stand-in for simulated versions);
3. model name resolved (alias, ``@vN`` pin, canary by conversation, shadow share);
4. admission (the seam for token buckets and tiers) charges prompt + max tokens;
5. a replica is chosen by the pool's policy on the routing key; on a connect error
   or a 5xx before the first token the next candidate is tried, within the pool's
   retry budget; after the first token a failure is an explicit error event;
6. upstream SSE events are forwarded as bytes (never re-serialised); only the final
   usage chunk is parsed, extended with ``cached_tokens``, ``model_version``,
   ``region`` and ``replica_id``, and sent before ``data: [DONE]``;
7. usage is counted once per request when it ends, disconnects included, and the
   admission ticket is released with the tokens actually used.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import math
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from config.errors import error_body
from metering import metrics
from metering.domain.usage import UsageCounts, UsageKey
from routing.admission import (
    Admission,
    AdmissionRequest,
    OpenAdmission,
    Rejected,
    Ticket,
)
from routing.domain.policies import RouteRequest, RoutingPolicy, make_policy
from routing.domain.resolve import (
    NoLiveVersion,
    Resolution,
    UnknownModel,
    UnknownVersion,
    resolve,
)
from routing.domain.retry_budget import RetryBudget
from routing.domain.routing_key import routing_key
from routing.domain.snapshot import ConfigSnapshot, LimitRecord
from routing.domain.tiers import Tier, parse_tier
from routing.live import LiveLoad
from routing.prompt_tokens import PromptRejected, VersionCounters

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_JSON = (b"content-type", b"application/json")
_DONE = b"data: [DONE]\n\n"
_EVENT_END = b"\n\n"
_USAGE_MARK = b'"choices":[]'
# Every token event of vLLM (and the simulator) has a non-empty choices list; the
# usage chunk, error events and [DONE] do not.
_CONTENT_MARK = b'"choices":[{'
# Tokens in flight are lowered every this many events (not per event): cheap, and
# within a few tokens of exact for routing.
_SHRINK_EVERY = 8
_GC_THRESHOLDS = (50_000, 20, 10)
_ALLOWED_ROLES = {"system", "developer", "user", "assistant", "tool"}
# Body fields the gateway sets itself; everything else passes to the engine.
_GATEWAY_FIELDS = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
}


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """What the gateway reads from settings once, at start."""

    region: str
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = 1024
    default_tokens_per_minute: int = 0
    default_max_concurrency: int = 0
    retry_ratio: float = 0.1
    retry_min: int = 3
    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 60.0
    shadow_concurrency: int = 16
    affinity_min_bound_tokens: int = 16_384
    engine_api_key: str = ""


class GatewayError(Exception):
    """A failure answered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        return json.dumps(
            error_body(
                self.status,
                self.message,
                param=self.param,
                code=self.code,
                error_type=self.error_type,
            )
        ).encode()


class _UpstreamFailed(Exception):
    """The chosen replica failed before the first token: another may be tried."""


@dataclass(slots=True)
class _Call:
    """One request's state while it streams."""

    request_id: str
    team: str
    model_ref: str
    resolution: Resolution
    tier: Tier
    prompt_tokens: int
    max_tokens: int
    stream: bool
    started_at: float
    replica_id: str = ""
    in_flight: int = 0  # tokens counted on the replica in LiveLoad
    events: int = 0  # content events forwarded (an estimate of output tokens)
    first_token_at: float | None = None
    usage: dict[str, Any] | None = None
    content: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    response_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    watch: _DisconnectWatch | None = None


class Gateway:
    """The gateway of one process: snapshot, live load, policies, upstream pool."""

    def __init__(
        self,
        *,
        settings: GatewaySettings,
        load_snapshot: Callable[[], Awaitable[ConfigSnapshot]],
        live: LiveLoad,
        usage_counter: Any,
        admission: Admission | None = None,
        snapshot_refresh_s: float = 2.0,
        exchange_s: float = 1.0,
        flush_usage: Callable[[], Awaitable[None]] | None = None,
        flush_usage_s: float = 10.0,
    ) -> None:
        self.settings = settings
        self.load_snapshot = load_snapshot
        self.live = live
        self.usage_counter = usage_counter
        self.admission: Admission = admission or OpenAdmission()
        self.snapshot_refresh_s = snapshot_refresh_s
        self.exchange_s = exchange_s
        self.flush_usage = flush_usage
        self.flush_usage_s = flush_usage_s
        self.snapshot: ConfigSnapshot | None = None
        self.snapshot_ok_at = 0.0  # monotonic time of the last successful refresh
        self.control_plane_up = False
        self._policies: dict[tuple[str, str], RoutingPolicy] = {}
        self._budgets: dict[tuple[str, str], RetryBudget] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._shadow_slots = asyncio.Semaphore(settings.shadow_concurrency)
        self._background: set[asyncio.Task[Any]] = set()
        self._random = random.Random()
        self.prompt_counters = VersionCounters()
        self._upstream_headers = {"content-type": "application/json"}
        if settings.engine_api_key:
            self._upstream_headers["authorization"] = (
                f"Bearer {settings.engine_api_key}"
            )

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the first snapshot, open the upstream pool, start background loops."""
        if self._session is not None:
            return
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=4.0, enable_cleanup_closed=True
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=None, connect=self.settings.connect_timeout_s
            ),
            auto_decompress=False,
        )
        await self.refresh_snapshot()
        await self._exchange_once()
        self._tasks = [
            asyncio.create_task(
                self._every(self.snapshot_refresh_s, self.refresh_snapshot)
            ),
            asyncio.create_task(self._every(self.exchange_s, self._exchange_once)),
        ]
        if self.flush_usage is not None:
            self._tasks.append(
                asyncio.create_task(self._every(self.flush_usage_s, self.flush_usage))
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
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.flush_usage is not None:
            with contextlib.suppress(Exception):
                await self.flush_usage()
        with contextlib.suppress(Exception):
            await self.live.leave()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def refresh_snapshot(self) -> None:
        """Swap in a fresh snapshot; on failure keep serving the last one."""
        try:
            snapshot = await self.load_snapshot()
        except Exception as exc:
            if self.control_plane_up or self.snapshot is None:
                logger.warning(
                    "control plane unreachable, serving the last snapshot: %s",
                    type(exc).__name__,
                )
            self.control_plane_up = False
            metrics.set_control_plane(up=False, snapshot_age_s=self.snapshot_age_s())
            return
        self.snapshot = snapshot
        self.snapshot_ok_at = time.monotonic()
        self.prompt_counters.prepare(snapshot.versions.values())
        if not self.control_plane_up:
            logger.info(
                "control plane snapshot loaded (%d models, %d replicas)",
                len(snapshot.models),
                len(snapshot.replicas),
            )
        self.control_plane_up = True
        metrics.set_control_plane(up=True, snapshot_age_s=0.0)

    def snapshot_age_s(self) -> float | None:
        """Seconds since the last successful snapshot, None if there never was one."""
        if self.snapshot is None:
            return None
        return time.monotonic() - self.snapshot_ok_at

    async def _exchange_once(self) -> None:
        try:
            await self.live.exchange()
        except Exception as exc:
            logger.warning("live load exchange failed: %s", type(exc).__name__)
        self._publish_pool_gauges()

    def _publish_pool_gauges(self) -> None:
        """Set each pool's tokens in flight and queue depth (once a second)."""
        snapshot = self.snapshot
        if snapshot is None:
            return
        pools: dict[tuple[str, str], list[int]] = {}
        for replica in snapshot.replicas:
            totals = pools.setdefault((replica.model, replica.version), [0, 0])
            totals[0] += self.live.tokens_in_flight(replica.replica_id)
            beat = self.live.beats.get(replica.replica_id)
            totals[1] += beat.queue_depth if beat else replica.queue_depth
        for (model, version), (tokens_in_flight, queue_depth) in pools.items():
            metrics.set_pool_load(
                model=model,
                version=version,
                region=self.settings.region,
                tokens_in_flight=tokens_in_flight,
                queue_depth=queue_depth,
            )

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
        if self._session is None:
            await self.start()
        path = scope["path"]
        method = scope["method"]
        try:
            if path == "/v1/chat/completions":
                if method != "POST":
                    raise GatewayError(405, "use POST for /v1/chat/completions")
                await self._chat(scope, receive, send)
            elif path == "/v1/models":
                if method != "GET":
                    raise GatewayError(405, "use GET for /v1/models")
                await self._models(scope, send)
            elif path == "/healthz":
                await self._health(send)
            else:
                raise GatewayError(404, f"no such endpoint: {path}")
        except GatewayError as exc:
            await _respond(send, exc.status, exc.body(), headers=exc.headers)
        except _ClientGone:
            return

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
        age = self.snapshot_age_s()
        body = {
            "status": "ok" if self.control_plane_up else "degraded",
            "control_plane": "up" if self.control_plane_up else "unreachable",
            "snapshot_age_s": None if age is None else round(age, 3),
            "region": self.settings.region,
        }
        status = 200 if self.snapshot is not None else 503
        await _respond(send, status, json.dumps(body).encode())

    def _snapshot(self) -> ConfigSnapshot:
        if self.snapshot is None:
            raise GatewayError(
                503,
                "the gateway has no configuration yet; retry shortly",
                headers={"retry-after": "2"},
            )
        return self.snapshot

    def _authenticate(self, scope: Scope, snapshot: ConfigSnapshot) -> str:
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, secret = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise GatewayError(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                error_type="invalid_request_error",
            )
        key = snapshot.keys.get(hashlib.sha256(secret.strip().encode()).hexdigest())
        if key is None:
            raise GatewayError(
                401,
                "invalid API key",
                code="invalid_api_key",
                error_type="invalid_request_error",
            )
        return key.team

    def _limit(
        self, snapshot: ConfigSnapshot, team: str, model: str
    ) -> LimitRecord | None:
        """Return the team's limits on a model; default limits when allowed; else None."""
        limit = snapshot.limits.get((team, model))
        if limit is not None:
            return limit
        if self.settings.default_tokens_per_minute > 0:
            return LimitRecord(
                team=team,
                model=model,
                tokens_per_minute=self.settings.default_tokens_per_minute,
                max_concurrency=self.settings.default_max_concurrency or 10**6,
                guaranteed_share=0.0,
            )
        return None

    async def _models(self, scope: Scope, send: Send) -> None:
        snapshot = self._snapshot()
        team = self._authenticate(scope, snapshot)
        data = [
            {
                "id": name,
                "object": "model",
                "created": int(snapshot.built_at),
                "owned_by": "platform",
                "live_version": record.live_version,
            }
            for name, record in sorted(snapshot.models.items())
            if record.live_version is not None and self._limit(snapshot, team, name)
        ]
        await _respond(send, 200, json.dumps({"object": "list", "data": data}).encode())

    # -- chat completions --------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        started_at = time.monotonic()
        snapshot = self._snapshot()
        headers = {name: value for name, value in scope.get("headers", ())}
        team = self._authenticate(scope, snapshot)
        body = await _read_json(receive, headers, self.settings.max_body_bytes)
        # From here on a client that goes away cancels this task (queued admission
        # included); reads from the engine need no per-chunk race with the client.
        task = asyncio.current_task()
        assert task is not None
        watch = _DisconnectWatch(task)
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(watch.on_disconnect)
        try:
            await self._admitted_chat(
                scope, headers, team, body, snapshot, started_at, send, watch
            )
        except asyncio.CancelledError:
            if not watch.fired:
                raise
            task.uncancel()
            raise _ClientGone from None
        finally:
            watch.finished = True
            watcher.cancel()

    async def _admitted_chat(
        self,
        scope: Scope,
        headers: Mapping[bytes, bytes],
        team: str,
        body: dict[str, Any],
        snapshot: ConfigSnapshot,
        started_at: float,
        send: Send,
        watch: _DisconnectWatch,
    ) -> None:
        try:
            tier = parse_tier(_header(headers, b"x-priority"))
        except ValueError as exc:
            raise GatewayError(400, str(exc), param="x-priority") from None
        model_ref, messages, stream, max_tokens_asked = _check_body(body)
        conversation_id = _header(headers, b"x-conversation-id")
        key = routing_key(conversation_id, messages)
        try:
            resolution = resolve(
                model_ref,
                snapshot.models,
                snapshot.versions,
                key,
                self._random.random(),
            )
        except (UnknownModel, UnknownVersion) as exc:
            raise GatewayError(
                404, str(exc), param="model", code="model_not_found"
            ) from None
        except NoLiveVersion as exc:
            raise GatewayError(
                503, str(exc), param="model", headers={"retry-after": "5"}
            ) from None
        limit = self._limit(snapshot, team, resolution.model)
        if limit is None:
            raise GatewayError(
                403,
                f"team {team!r} may not use model {resolution.model!r}",
                param="model",
                code="model_not_allowed",
                error_type="permission_error",
            )
        version = snapshot.versions.get((resolution.model, resolution.version))
        max_model_len = version.max_model_len if version else 8192
        try:
            prompt_tokens = await self.prompt_counters.count(version, messages)
        except PromptRejected as exc:
            raise GatewayError(400, str(exc), param="messages") from None
        if max_tokens_asked is None:
            max_tokens = max(
                1, min(self.settings.default_max_tokens, max_model_len - prompt_tokens)
            )
        else:
            max_tokens = max_tokens_asked
        if prompt_tokens + max_tokens > max_model_len:
            raise GatewayError(
                400,
                f"This model's maximum context length is {max_model_len} tokens; the "
                f"messages take {prompt_tokens} and max_tokens asks {max_tokens}.",
                param="messages",
                code="context_length_exceeded",
            )
        call = _Call(
            request_id=f"chatcmpl-{secrets.token_hex(12)}",
            team=team,
            model_ref=model_ref,
            resolution=resolution,
            tier=tier,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            stream=stream,
            started_at=started_at,
        )
        try:
            ticket = await self.admission.admit(
                AdmissionRequest(
                    team=team,
                    model=resolution.model,
                    version=resolution.version,
                    tier=tier,
                    prompt_tokens=prompt_tokens,
                    max_tokens=max_tokens,
                    limit=limit,
                )
            )
        except Rejected as exc:
            raise self._rejection(
                exc, team=team, tier=tier, resolution=resolution
            ) from None
        except Exception as exc:
            # The limiter's store (Redis) failed: refuse clearly rather than admit
            # without limits or answer a bare 500.
            logger.warning("admission unavailable: %s", type(exc).__name__)
            raise GatewayError(
                503,
                "limits cannot be checked right now; retry shortly",
                code="admission_unavailable",
                headers={"retry-after": "1"},
            ) from None
        upstream_body = dict(body)
        for name in _GATEWAY_FIELDS:
            upstream_body.pop(name, None)
        upstream_body.update(
            model=resolution.model,
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=max_tokens,
        )
        payload = json.dumps(upstream_body).encode()
        if resolution.shadow_version is not None:
            self._spawn(self._shadow(snapshot, resolution, payload, key))
        try:
            await self._relay(call, snapshot, key, payload, send, ticket, watch)
        finally:
            used = (
                self._final_usage(call)["total_tokens"]
                if call.first_token_at is not None
                else 0
            )
            try:
                await ticket.release(used_tokens=used)
            except Exception as exc:
                # The answer is complete: a failed refund must not break the
                # connection. The bucket refills by itself; the slot expires.
                logger.warning("releasing admission failed: %s", type(exc).__name__)

    def _rejection(
        self, exc: Rejected, *, team: str, tier: Tier, resolution: Resolution
    ) -> GatewayError:
        """Count a refusal (metrics and usage) and turn it into the client's error.

        Every 429 and 503 carries Retry-After with up to a second of jitter, so that
        refused clients do not all come back in the same instant (retry storms).
        """
        headers = dict(exc.headers)
        if exc.status in (429, 503):
            metrics.count_rejection(
                team=team, model=resolution.model, tier=tier.value, status=exc.status
            )
            counts = (
                UsageCounts(rate_limited=1)
                if exc.status == 429
                else UsageCounts(shed=1)
            )
            self._spawn(
                self.usage_counter.add(
                    UsageKey.from_time(
                        team, resolution.model, resolution.version, time.time()
                    ),
                    counts,
                )
            )
            jittered = max(1, math.ceil(exc.retry_after_s + self._random.random()))
            headers["retry-after"] = str(jittered)
        error_type = "rate_limit_error" if exc.status == 429 else None
        return GatewayError(
            exc.status,
            exc.message,
            code=exc.code,
            headers=headers,
            error_type=error_type,
        )

    async def _relay(
        self,
        call: _Call,
        snapshot: ConfigSnapshot,
        key: str,
        payload: bytes,
        send: Send,
        ticket: Ticket,
        watch: _DisconnectWatch,
    ) -> None:
        call.watch = watch
        model, version = call.resolution.model, call.resolution.version
        pool = (model, version)
        policy = self._policies.get(pool)
        if policy is None:
            record = snapshot.models.get(model)
            policy = self._policies[pool] = make_policy(
                record.policy if record else "prefix_affinity"
            )
            if hasattr(policy, "min_bound_tokens"):
                policy.min_bound_tokens = self.settings.affinity_min_bound_tokens
        budget = self._budgets.get(pool)
        if budget is None:
            budget = self._budgets[pool] = RetryBudget(
                ratio=self.settings.retry_ratio, min_retries=self.settings.retry_min
            )
        now = time.monotonic()
        budget.record_request(now)
        nodes = self.live.nodes(snapshot, model, version, now)
        decision = policy.choose(
            RouteRequest(
                model=model,
                version=version,
                routing_key=key,
                team=call.team,
                request_tokens=call.prompt_tokens + call.max_tokens,
            ),
            nodes,
            now,
        )
        urls = {node.replica_id: node.url for node in nodes}
        outcome = "error"
        try:
            for attempt, replica_id in enumerate(decision.candidates):
                if attempt > 0:
                    if not budget.try_spend(time.monotonic()):
                        break
                    metrics.count_retry(
                        model=model, version=version, region=self.settings.region
                    )
                try:
                    outcome = await self._attempt(
                        call, replica_id, urls[replica_id], payload, send, ticket
                    )
                    return
                except asyncio.CancelledError:
                    outcome = "client_closed"
                    raise
                except _UpstreamFailed as exc:
                    logger.warning(
                        "replica %s failed before the first token: %s", replica_id, exc
                    )
                    self.live.eject(replica_id, time.monotonic())
                    continue
            retry_after = str(1 + self._random.randint(0, 2))
            raise GatewayError(
                503,
                f"no replica of {model}@{version} can serve right now",
                code="no_replica_available",
                headers={"retry-after": retry_after},
            )
        finally:
            self._finish(call, outcome)

    async def _attempt(
        self,
        call: _Call,
        replica_id: str,
        url: str,
        payload: bytes,
        send: Send,
        ticket: Ticket,
    ) -> str:
        """Stream one attempt; return the outcome, or raise ``_UpstreamFailed``."""
        assert self._session is not None
        call.replica_id = replica_id
        call.in_flight = call.prompt_tokens + call.max_tokens
        self.live.add(replica_id, call.in_flight)
        response: aiohttp.ClientResponse | None = None
        try:
            try:
                response = await self._session.post(
                    f"{url}/v1/chat/completions",
                    data=payload,
                    headers=self._upstream_headers,
                )
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise _UpstreamFailed(type(exc).__name__) from None
            if response.status >= 500:
                raise _UpstreamFailed(f"HTTP {response.status}")
            if response.status in (401, 403):
                # The engine refused the gateway's engine key (vLLM: 401
                # {"error":"Unauthorized"}): the platform's fault, not the client's.
                raise _UpstreamFailed(
                    f"HTTP {response.status}: the replica refused the engine API key"
                )
            if response.status != 200:
                raw = await response.read()
                raise _upstream_client_error(response.status, raw)
            # The relay loop runs as a task of its own: each engine chunk then
            # resumes this one coroutine, not the whole chain of frames above it
            # (the server, the router, _chat ... _attempt), which cost about 10% of
            # the relay's CPU per token. Cancelling this task cancels the relay.
            return await asyncio.ensure_future(
                self._forward(call, response, send, ticket)
            )
        finally:
            if response is not None:
                response.release() if call.usage else response.close()
            self.live.remove(replica_id, call.in_flight)
            call.in_flight = 0

    async def _forward(
        self,
        call: _Call,
        response: aiohttp.ClientResponse,
        send: Send,
        ticket: Ticket,
    ) -> str:
        """Relay the engine's SSE events; return the outcome."""
        started = False
        fast = False  # streaming, past the first event: forward bytes as they come
        unshrunk = 0  # events not yet taken off the replica's tokens in flight
        buffer = b""
        reader = response.content
        while True:
            try:
                chunk = await reader.readany()
            except (TimeoutError, aiohttp.ClientError, OSError):
                chunk = b""
            if not chunk:
                # The engine went away before [DONE].
                if not started:
                    raise _UpstreamFailed("connection closed before the first token")
                await self._send_stream_error(call, send)
                return "error"
            if buffer:
                chunk = buffer + chunk
                buffer = b""
            if (
                fast
                and chunk.endswith(_EVENT_END)
                and (events := chunk.count(_EVENT_END)) == chunk.count(_CONTENT_MARK)
            ):
                # The common case: whole token events only. Forward the bytes as
                # they came, counting events, without splitting or copying them.
                call.events += events
                unshrunk += events
                if unshrunk >= _SHRINK_EVERY:
                    call.in_flight = self._shrink(call, unshrunk)
                    unshrunk = 0
                await send(
                    {"type": "http.response.body", "body": chunk, "more_body": True}
                )
                continue
            end = chunk.rfind(_EVENT_END)
            if end < 0:
                buffer = chunk
                continue
            complete, buffer = chunk[: end + 2], chunk[end + 2 :]
            out = []
            done = False
            for event in complete.split(_EVENT_END):
                if not event:
                    continue
                if event.startswith(b"data: [DONE]"):
                    done = True
                    continue
                if _USAGE_MARK in event:
                    call.usage = json.loads(event[6:]).get("usage") or {}
                    continue
                if event.startswith(b'data: {"error"'):
                    if not started:
                        raise _UpstreamFailed("error event before the first token")
                    await self._send_stream_error(call, send)
                    return "error"
                out.append(event)
            if out:
                if not started:
                    started = True
                    fast = call.stream
                    call.first_token_at = time.monotonic()
                    await self._start_response(call, send, ticket)
                # Role chunk included: an estimate until the usage chunk arrives.
                call.events += len(out)
                call.in_flight = self._shrink(call, len(out))
                if call.stream:
                    await send(
                        {
                            "type": "http.response.body",
                            "body": _EVENT_END.join(out) + _EVENT_END,
                            "more_body": True,
                        }
                    )
                else:
                    _collect(call, out)
            if done:
                if not started:
                    raise _UpstreamFailed("no tokens before [DONE]")
                await self._finish_response(call, send)
                return "ok"

    def _shrink(self, call: _Call, events: int) -> int:
        """Lower the request's tokens in flight as output tokens arrive."""
        left = max(call.prompt_tokens, call.in_flight - events)
        self.live.remove(call.replica_id, call.in_flight - left)
        return left

    async def _start_response(self, call: _Call, send: Send, ticket: Ticket) -> None:
        headers = [
            (b"x-request-id", call.request_id.encode()),
            (b"x-model-version", call.resolution.version.encode()),
            (b"x-region", self.settings.region.encode()),
            (b"x-replica-id", call.replica_id.encode()),
        ]
        headers.extend((k.encode(), v.encode()) for k, v in ticket.headers.items())
        if call.stream:
            headers[:0] = [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
            ]
            await send(
                {"type": "http.response.start", "status": 200, "headers": headers}
            )
        else:
            # A non-streaming answer sends its headers with the body, once complete.
            call.response_headers = headers

    def _final_usage(self, call: _Call) -> dict[str, Any]:
        upstream = call.usage or {}
        prompt = int(upstream.get("prompt_tokens", call.prompt_tokens))
        # Without the engine's usage (a broken stream), count content events: the
        # first event is the role chunk, which carries no token.
        completion = int(upstream.get("completion_tokens", max(0, call.events - 1)))
        details = upstream.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        return {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _finish_response(self, call: _Call, send: Send) -> None:
        # The last send completes the response, after which the server reports a
        # disconnect: that must not cancel the refund and metering that follow.
        if call.watch is not None:
            call.watch.finished = True
        usage = self._final_usage(call)
        call.usage = {**(call.usage or {}), **usage}
        created = int(time.time())
        if call.stream:
            final = {
                "id": call.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": call.model_ref,
                "choices": [],
                "usage": usage,
                "model_version": call.resolution.version,
                "region": self.settings.region,
                "replica_id": call.replica_id,
            }
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(final).encode() + _EVENT_END + _DONE,
                    "more_body": False,
                }
            )
            return
        answer = {
            "id": call.request_id,
            "object": "chat.completion",
            "created": created,
            "model": call.model_ref,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(call.content)},
                    "logprobs": None,
                    "finish_reason": call.finish_reason or "stop",
                }
            ],
            "usage": usage,
            "model_version": call.resolution.version,
            "region": self.settings.region,
            "replica_id": call.replica_id,
        }
        await _respond(
            send, 200, json.dumps(answer).encode(), raw_headers=call.response_headers
        )

    async def _send_stream_error(self, call: _Call, send: Send) -> None:
        """Tell the client its stream broke after tokens were sent (no retry then)."""
        if not call.stream:
            raise GatewayError(
                502,
                "the replica failed while answering; the answer is incomplete",
                code="upstream_failed",
                error_type="server_error",
            )
        error = error_body(
            502,
            "the replica failed mid-stream; the answer is incomplete",
            code="upstream_failed",
            error_type="server_error",
        )
        error["error"]["replica_id"] = call.replica_id
        with contextlib.suppress(Exception):
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(error).encode() + _EVENT_END + _DONE,
                    "more_body": False,
                }
            )

    def _finish(self, call: _Call, outcome: str) -> None:
        """Meter the request once, whatever happened (disconnects included)."""
        usage = self._final_usage(call) if call.first_token_at is not None else None
        model, version = call.resolution.model, call.resolution.version
        region = self.settings.region
        metrics.observe_request(
            model=model,
            version=version,
            region=region,
            team=call.team,
            outcome=outcome,
            ttft_s=(call.first_token_at - call.started_at)
            if call.first_token_at
            else None,
            duration_s=time.monotonic() - call.started_at,
            prompt_tokens=usage["prompt_tokens"] if usage else 0,
            cached_tokens=usage["cached_tokens"] if usage else 0,
            output_tokens=usage["completion_tokens"] if usage else 0,
        )
        if usage is None:
            return
        counts = UsageCounts(
            prompt_tokens=usage["prompt_tokens"],
            cached_tokens=min(usage["cached_tokens"], usage["prompt_tokens"]),
            output_tokens=usage["completion_tokens"],
            requests=1,
        )
        self._spawn(
            self.usage_counter.add(
                UsageKey.from_time(call.team, model, version, time.time()), counts
            )
        )

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    async def _shadow(
        self, snapshot: ConfigSnapshot, resolution: Resolution, payload: bytes, key: str
    ) -> None:
        """Send a copy to the shadow version; discard the answer, record its latency."""
        if self._shadow_slots.locked() or self._session is None:
            return  # shadows never queue behind each other or the caller
        version = resolution.shadow_version
        assert version is not None
        async with self._shadow_slots:
            nodes = self.live.nodes(
                snapshot, resolution.model, version, time.monotonic()
            )
            if not nodes:
                return
            node = min(nodes, key=lambda n: n.tokens_in_flight)
            started = time.monotonic()
            outcome = "ok"
            try:
                async with self._session.post(
                    f"{node.url}/v1/chat/completions",
                    data=payload,
                    headers=self._upstream_headers,
                ) as response:
                    first = None
                    async for _ in response.content.iter_any():
                        if first is None:
                            first = time.monotonic()
                    if response.status != 200:
                        outcome = "error"
            except (TimeoutError, aiohttp.ClientError, OSError):
                outcome = "error"
                first = None
            metrics.observe_shadow(
                model=resolution.model,
                version=version,
                region=self.settings.region,
                outcome=outcome,
                ttft_s=(first - started) if first else None,
            )


class _ClientGone(Exception):
    """The client disconnected."""


class _DisconnectWatch:
    """Cancel a request's task when its client disconnects, until it has finished."""

    __slots__ = ("finished", "fired", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.finished = False
        self.fired = False

    def on_disconnect(self, watcher: asyncio.Future[None]) -> None:
        if watcher.cancelled() or self.finished:
            return
        self.fired = True
        self.task.cancel()


def _collect(call: _Call, events: list[bytes]) -> None:
    """Gather a non-streaming answer's text from the engine's chunks."""
    for event in events:
        chunk = json.loads(event[6:])
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                call.content.append(delta["content"])
            if choice.get("finish_reason"):
                call.finish_reason = choice["finish_reason"]


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("background task failed: %r", task.exception())


def _header(headers: Mapping[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return value.decode("latin-1") if value is not None else None


async def _read_json(
    receive: Receive, headers: Mapping[bytes, bytes], limit: int
) -> dict[str, Any]:
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(
            413, f"request body is larger than {limit} bytes", code="request_too_large"
        )
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(
                413,
                f"request body is larger than {limit} bytes",
                code="request_too_large",
            )
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GatewayError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object")
    return body


def _check_body(
    body: Mapping[str, Any],
) -> tuple[str, list[dict[str, Any]], bool, int | None]:
    """Validate the OpenAI fields the gateway relies on; return what it needs."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "model is required", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ALLOWED_ROLES:
            raise GatewayError(
                400,
                f"each message needs a role of {', '.join(sorted(_ALLOWED_ROLES))}",
                param=f"messages.{index}.role",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise GatewayError(
                400,
                "content must be a string or a list of parts",
                param=f"messages.{index}.content",
            )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        not isinstance(max_tokens, int)
        or isinstance(max_tokens, bool)
        or max_tokens < 1
    ):
        param = (
            "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        )
        raise GatewayError(400, f"{param} must be a positive integer", param=param)
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is not None and (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not low <= value <= high
        ):
            raise GatewayError(
                400, f"{name} must be a number between {low:g} and {high:g}", param=name
            )
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str)
        or (
            isinstance(stop, list)
            and len(stop) <= 4
            and all(isinstance(s, str) for s in stop)
        )
    ):
        raise GatewayError(
            400, "stop must be a string or a list of up to 4 strings", param="stop"
        )
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise GatewayError(400, "seed must be an integer", param="seed")
    if body.get("n", 1) != 1:
        raise GatewayError(400, "n must be 1", param="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise GatewayError(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise GatewayError(
            400, "stream_options must be an object", param="stream_options"
        )
    return model, messages, stream, max_tokens


def _upstream_client_error(status: int, raw: bytes) -> GatewayError:
    """Turn an engine's 4xx (vLLM shape, integer code) into OpenAI's shape."""
    message = "the replica refused the request"
    param = None
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        error = json.loads(raw)["error"]
        message = str(error.get("message") or message)
        param = error.get("param")
    return GatewayError(
        status if status in (400, 404, 413, 422) else 400, message, param=param
    )


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    *,
    headers: Mapping[str, str] | None = None,
    raw_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    out = [_JSON, (b"content-length", str(len(body)).encode())]
    out.extend((k.encode(), v.encode()) for k, v in (headers or {}).items())
    out.extend(raw_headers or [])
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})
