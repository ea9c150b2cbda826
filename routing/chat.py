"""One planned chat request, served: admitted, routed, relayed, metered, given back.

Public surface: ``ChatService``, ``BackgroundTasks``, ``UsageCounter``.

The steps (seed steps 6-9 and 12), each taking what the one before produced:

1. admission (``routing.admission``) turns the ``ChatPlan`` into a ``Ticket`` or a
   429/503 with Retry-After (jittered, so refused clients do not all return at
   once); a shadow copy goes out if the plan's resolution names one;
2. the pool's routing policy orders the replicas for the routing key; on a connect
   error, a 5xx or no first token within ``first_token_timeout_s`` the next one is
   tried, within the pool's retry budget, unseen by the client; the replica that
   failed is ejected for the missed-beat window;
3. the ``Relay`` forwards the engine's events; the answer ends with the final
   event (``routing.responses``), or with an error event after a mid-stream
   failure (the replica died, or was silent for ``inter_token_timeout_s``; it is
   ejected too);
4. the ``FinalUsage`` is worked out once, when the answer ends (a client that left
   included), and used for the refund, the metrics and the usage row; for a model
   under rollout (a canary or a shadow set), the request's figures go to its
   version's bucket too (``metering.figures``: role live or canary, pinned
   requests left out), the answer's head judged by the refusal detector; batch
   work (``ChatPlan.is_batch_work``) is counted in its own part of the row too.

The request's tokens in flight on its replica are counted in ``LiveLoad`` while it
streams (prompt plus remaining output), so routing sees them at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from config.asgi_io import ChunkedWrite, Send
from metering import metrics
from metering.domain.figures import Role, VersionFigures, one_request
from metering.domain.usage import UsageCounts, UsageKey
from metering.figures import FigureKey, FigureRecorder
from routing.admission import Admission
from routing.domain.admission_control import AdmissionRequest, Rejected, Ticket
from routing.domain.policies import RouteRequest, RoutingPolicy, make_policy
from routing.domain.refusals import RefusalDetector
from routing.domain.retry_budget import RetryBudget
from routing.domain.snapshot import ConfigSnapshot
from routing.domain.sticky import (
    Remembered,
    figure_role,
    first_choice,
    needs_memory,
    routable_versions,
    stick,
)
from routing.engine_http import EngineResponse
from routing.live import AttemptLoad, LiveLoad
from routing.plan import ChatPlan, GatewaySettings, payload_for
from routing.relay import Relay, UpstreamFailed
from routing.responses import (
    FinalUsage,
    GatewayError,
    answer_headers,
    final_event,
    respond,
    stream_error_event,
    upstream_client_error,
    whole_answer,
)
from routing.shadow import Shadow
from routing.sticky import ConversationVersions
from routing.upstream import Upstream

logger = logging.getLogger(__name__)

__all__ = ["BackgroundTasks", "ChatService", "UsageCounter"]

_DEFAULT_POLICY = "prefix_affinity"


class UsageCounter(Protocol):
    """Where usage is counted until the flush (Redis, or memory)."""

    async def add(self, key: UsageKey, counts: UsageCounts) -> None:
        """Add ``counts`` to the row of ``key``."""
        ...


class BackgroundTasks:
    """Fire-and-forget tasks of the gateway (usage counts, shadow copies).

    Kept referenced until done (asyncio holds only weak references), failures
    logged, and awaited at shutdown.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` in the background."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    async def drain(self) -> None:
        """Wait for every task still running."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class _NoFirstToken(UpstreamFailed):
    """The replica sent no first token within the deadline."""


class _Served:
    """How far one request got: its current attempt and, at the end, its usage.

    Written only by ``ChatService.serve``, ``_route`` and ``_attempt``; read in
    ``serve``'s ``finally`` (which runs after a client disconnect too).
    ``figure_role`` is the role the request's figures count for (None: not
    recorded); ``error_kind`` how it failed, as the guards count it
    (``metering.domain.figures.ERROR_KINDS``); ``is_client_error`` a 4xx, which
    is no error of the version.
    """

    __slots__ = (
        "error_kind",
        "figure_role",
        "is_client_error",
        "outcome",
        "relay",
        "replica_id",
        "usage",
    )

    def __init__(self, figure_role: Role | None = None) -> None:
        self.outcome: metrics.Outcome = "error"
        self.replica_id = ""
        self.relay: Relay | None = None
        self.usage: FinalUsage | None = None
        self.figure_role = figure_role
        self.error_kind: str | None = None
        self.is_client_error = False

    @property
    def first_token_at(self) -> float | None:
        return self.relay.first_token_at if self.relay is not None else None

    def final_usage(self, plan: ChatPlan) -> FinalUsage | None:
        """Return the answer's usage; None when no token reached the client."""
        relay = self.relay
        if self.usage is None and relay is not None and relay.first_token_at:
            self.usage = FinalUsage.of(
                relay.outcome(), prompt_tokens=plan.prompt_tokens
            )
        return self.usage


class ChatService:
    """Admit, route, relay and meter planned chat requests (one per gateway)."""

    def __init__(
        self,
        *,
        settings: GatewaySettings,
        live: LiveLoad,
        admission: Admission,
        upstream: Upstream,
        usage_counter: UsageCounter,
        background: BackgroundTasks,
        rng: random.Random,
        figures: FigureRecorder | None = None,
        conversations: ConversationVersions | None = None,
    ) -> None:
        self.settings = settings
        self.live = live
        self.admission = admission
        self.upstream = upstream
        self.usage_counter = usage_counter
        self.background = background
        self.rng = rng
        self.figures = figures
        self.conversations = conversations
        self.refusals = RefusalDetector(settings.refusal_patterns)
        self.shadow = Shadow(
            live=live,
            upstream=upstream,
            region=settings.region,
            concurrency=settings.shadow_concurrency,
            figures=figures,
            detector=self.refusals,
            bucket_s=settings.figures_bucket_s,
        )
        # Mutable routing state, one of each per pool (model, version).
        self._policies: dict[tuple[str, str], RoutingPolicy] = {}
        self._budgets: dict[tuple[str, str], RetryBudget] = {}

    async def serve(
        self,
        plan: ChatPlan,
        snapshot: ConfigSnapshot,
        send: Send,
        *,
        before_last_send: Callable[[], None],
        write_frames: ChunkedWrite | None = None,
    ) -> None:
        """Answer ``plan`` on ``send``.

        ``write_frames``: the server's write of chunk frames to the client
        (``config.http_protocol``), which the relay uses where it can.

        ``before_last_send`` is called just before the message that completes the
        answer: after it the server reports the client gone, which must no longer
        cancel the refund and metering that follow.

        Raises:
            GatewayError: refused before any byte of the answer was sent.
        """
        plan, remembered = await self._remember(plan, snapshot)
        ticket = await self._admit(plan)
        resolution = plan.resolution
        if resolution.shadow_version is not None:
            self.background.spawn(
                self.shadow.copy(
                    snapshot,
                    model=resolution.model,
                    version=resolution.shadow_version,
                    payload=payload_for(
                        plan.payload,
                        plan.tier,
                        snapshot.versions.get(
                            (resolution.model, resolution.shadow_version)
                        ),
                    ),
                    conversation=plan.routing_key,
                )
            )
        served = _Served(self._figure_role(plan, snapshot, remembered))
        try:
            await self._route(
                plan, snapshot, send, ticket, served, before_last_send, write_frames
            )
        except GatewayError as exc:
            served.is_client_error = exc.status < 500
            raise
        finally:
            usage = served.final_usage(plan)
            self._meter(plan, served, usage)
            try:
                await self.admission.release(
                    ticket, used_tokens=usage.total_tokens if usage else 0
                )
            except Exception as exc:
                # The answer is complete: a failed refund must not break the
                # connection. The bucket refills by itself; the slot expires.
                logger.warning("releasing admission failed: %s", type(exc).__name__)

    async def _remember(
        self, plan: ChatPlan, snapshot: ConfigSnapshot
    ) -> tuple[ChatPlan, Remembered | None]:
        """Send the turn to its conversation's version while a rollout runs.

        One round trip (``routing.sticky``), only for a model with a rollout on;
        the plan is returned with the version the conversation keeps.
        """
        resolution = plan.resolution
        if self.conversations is None or resolution.is_pinned:
            return plan, None
        record = snapshot.models.get(resolution.model)
        if record is None or not needs_memory(record):
            return plan, None
        remembered = await self.conversations.choose(
            resolution.model,
            plan.routing_key,
            first_choice(
                resolution,
                record,
                first_turn=plan.first_turn,
                routing_key=plan.routing_key,
            ),
            routable_versions(record),
        )
        stuck = stick(resolution, remembered, record)
        if stuck is not resolution:
            payload = plan.payload
            if stuck.version != resolution.version:
                payload = payload_for(
                    payload,
                    plan.tier,
                    snapshot.versions.get((stuck.model, stuck.version)),
                )
            plan = dataclasses.replace(plan, resolution=stuck, payload=payload)
        return plan, remembered

    def _figure_role(
        self,
        plan: ChatPlan,
        snapshot: ConfigSnapshot,
        remembered: Remembered | None,
    ) -> Role | None:
        """Return the role the request's figures count for; None: not recorded.

        Only a model under rollout (a canary or a shadow set) is recorded, and
        only requests the alias resolved: a pinned one chose its version
        (``routing.domain.sticky.figure_role``).
        """
        if self.figures is None:
            return None
        record = snapshot.models.get(plan.resolution.model)
        if record is None:
            return None
        role = figure_role(plan.resolution, remembered, record)
        return Role(role) if role is not None else None

    # -- admission ------------------------------------------------------------------

    async def _admit(self, plan: ChatPlan) -> Ticket:
        resolution = plan.resolution
        try:
            return await self.admission.admit(
                AdmissionRequest(
                    team=plan.team,
                    model=resolution.model,
                    version=resolution.version,
                    tier=plan.tier,
                    prompt_tokens=plan.prompt_tokens,
                    max_tokens=plan.max_tokens,
                    limit=plan.limit,
                )
            )
        except Rejected as exc:
            raise self._refusal(exc, plan) from None
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

    def _refusal(self, exc: Rejected, plan: ChatPlan) -> GatewayError:
        """Count a refusal (metrics and usage) and turn it into the client's error.

        Every 429 and 503 carries Retry-After with up to a second of jitter, so that
        refused clients do not all come back in the same instant (retry storms).
        """
        resolution = plan.resolution
        headers = dict(exc.headers)
        if exc.status in (429, 503):
            metrics.count_rejection(
                team=plan.team,
                model=resolution.model,
                tier=plan.tier.value,
                status=exc.status,
            )
            counts = (
                UsageCounts(rate_limited=1)
                if exc.status == 429
                else UsageCounts(shed=1)
            )
            self.background.spawn(
                self.usage_counter.add(
                    UsageKey.from_time(
                        plan.team, resolution.model, resolution.version, time.time()
                    ),
                    counts,
                )
            )
            jittered = max(1, math.ceil(exc.retry_after_s + self.rng.random()))
            headers["retry-after"] = str(jittered)
        return GatewayError(
            exc.status,
            exc.message,
            code=exc.code,
            headers=headers,
            error_type="rate_limit_error" if exc.status == 429 else None,
        )

    # -- routing ----------------------------------------------------------------------

    def _policy(
        self, snapshot: ConfigSnapshot, model: str, version: str
    ) -> RoutingPolicy:
        """Return the pool's policy, built anew if the model's policy changed."""
        record = snapshot.models.get(model)
        name = record.policy if record else _DEFAULT_POLICY
        policy = self._policies.get((model, version))
        if policy is None or policy.name != name:
            policy = self._policies[(model, version)] = make_policy(
                name, self.settings.policy_options
            )
        return policy

    def _budget(self, pool: tuple[str, str]) -> RetryBudget:
        budget = self._budgets.get(pool)
        if budget is None:
            budget = self._budgets[pool] = RetryBudget(
                ratio=self.settings.retry_ratio, min_retries=self.settings.retry_min
            )
        return budget

    async def _route(
        self,
        plan: ChatPlan,
        snapshot: ConfigSnapshot,
        send: Send,
        ticket: Ticket,
        served: _Served,
        before_last_send: Callable[[], None],
        write_frames: ChunkedWrite | None,
    ) -> None:
        model, version = plan.resolution.model, plan.resolution.version
        policy = self._policy(snapshot, model, version)
        budget = self._budget((model, version))
        now = time.monotonic()
        budget.record_request(now)
        nodes = self.live.nodes(snapshot, model, version, now)
        decision = policy.choose(
            RouteRequest(
                model=model,
                version=version,
                routing_key=plan.routing_key,
                team=plan.team,
                request_tokens=plan.request_tokens,
            ),
            nodes,
            now,
        )
        urls = {node.replica_id: node.url for node in nodes}
        timed_out = False
        for attempt, replica_id in enumerate(decision.candidates):
            if attempt > 0:
                if not budget.try_spend(time.monotonic()):
                    break
                metrics.count_retry(
                    model=model, version=version, region=self.settings.region
                )
            try:
                served.outcome = await self._attempt(
                    plan,
                    replica_id,
                    urls[replica_id],
                    send,
                    ticket,
                    served,
                    before_last_send,
                    write_frames,
                )
                return
            except asyncio.CancelledError:
                served.outcome = "client_closed"
                raise
            except UpstreamFailed as exc:
                logger.warning(
                    "replica %s failed before the first token: %s", replica_id, exc
                )
                self.live.eject(replica_id, time.monotonic())
                timed_out = isinstance(exc, _NoFirstToken)
        # No replica could start an answer: an error of the version all the same.
        served.error_kind = "timeout" if timed_out else "upstream"
        raise GatewayError(
            503,
            f"no replica of {model}@{version} can serve right now",
            code="no_replica_available",
            headers={"retry-after": str(1 + self.rng.randint(0, 2))},
        )

    async def _attempt(
        self,
        plan: ChatPlan,
        replica_id: str,
        url: str,
        send: Send,
        ticket: Ticket,
        served: _Served,
        before_last_send: Callable[[], None],
        write_frames: ChunkedWrite | None,
    ) -> metrics.Outcome:
        """Stream one attempt; return the outcome, or raise ``UpstreamFailed``."""
        region = self.settings.region
        version = plan.resolution.version

        def headers(answer_id: str) -> list[tuple[bytes, bytes]]:
            return answer_headers(
                request_id=answer_id,
                version=version,
                region=region,
                replica_id=replica_id,
                rate_limit=ticket.headers,
                stream=plan.stream,
            )

        response: EngineResponse | None = None
        # The first token's deadline, from now (connect and headers included).
        first_token = asyncio.timeout(self.settings.first_token_timeout_s)

        async def start(answer_id: str) -> None:
            # First, before any await: past here the deadline can no longer
            # cancel an answer that has begun. From now on the replica may stay
            # silent for inter_token_timeout_s between reads (the engine client).
            first_token.reschedule(None)
            if response is not None:
                response.expect_tokens()
            if plan.stream:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": headers(answer_id),
                    }
                )

        load = AttemptLoad(
            self.live, replica_id, tokens=plan.request_tokens, floor=plan.prompt_tokens
        )
        relay = Relay(
            send=send,
            stream=plan.stream,
            request_id=plan.request_id,
            on_first=start,
            on_tokens=load.shrink,
            # Only answers the rollout guards judge keep their head (refusals).
            capture_head=served.figure_role is not None,
            write_frames=write_frames,
        )
        served.replica_id, served.relay = replica_id, relay
        is_done = False
        try:
            try:
                async with first_token:
                    response = await self._open(url, plan.payload)
                    # The relay loop runs as a task of its own: each engine chunk
                    # then resumes this one coroutine, not the whole chain of
                    # frames above it (the server, the router, the gateway ...
                    # _attempt), which cost about 10% of the relay's CPU per token.
                    # Cancelling this task (the deadline, a client that left)
                    # cancels it.
                    is_done = await asyncio.ensure_future(relay.run(response))
            except TimeoutError:
                if not first_token.expired():
                    raise
                raise _NoFirstToken(
                    f"no first token within {self.settings.first_token_timeout_s:g} s"
                ) from None
            if not is_done:
                # Broken after its first token (died, sent an error, or silent for
                # the inter-token timeout): too late to retry, but new requests
                # avoid it for the missed-beat window (by then a dead one stopped
                # beating and a stalled one beats as stalled).
                logger.warning("replica %s broke a stream mid-way", replica_id)
                served.error_kind = "broken"
                self.live.eject(replica_id, time.monotonic())
                await self._end_broken(plan, replica_id, send, before_last_send)
                return "error"
            outcome = relay.outcome()
            usage = served.usage = FinalUsage.of(
                outcome, prompt_tokens=plan.prompt_tokens
            )
            # The answer's id is the engine's (every content chunk carries it), and
            # so is x-request-id.
            served_by = {
                "answer_id": outcome.answer_id,
                "model_ref": plan.model_ref,
                "version": version,
                "region": region,
                "replica_id": replica_id,
            }
            before_last_send()
            if plan.stream:
                await send(
                    {
                        "type": "http.response.body",
                        "body": final_event(
                            **served_by, usage=usage, include_usage=plan.include_usage
                        ),
                        "more_body": False,
                    }
                )
            else:
                body = whole_answer(**served_by, outcome=outcome, usage=usage)
                await respond(send, 200, body, raw_headers=headers(outcome.answer_id))
            return "ok"
        finally:
            if response is not None:
                # A stream read to [DONE] leaves a reusable connection.
                response.release() if is_done else response.close()
            load.drop()

    async def _open(self, url: str, payload: bytes) -> EngineResponse:
        """Send the request to a replica; return its 200 response, body unread.

        Raises:
            UpstreamFailed: no connection, a 5xx, or the engine refused the
                gateway's engine key: another replica may be tried.
            GatewayError: a 4xx the client's request caused, in OpenAI's shape.
        """
        try:
            response = await self.upstream.stream(url, payload)
        except (TimeoutError, OSError) as exc:
            raise UpstreamFailed(type(exc).__name__) from None
        if response.status == 200:
            return response
        try:
            if response.status >= 500:
                raise UpstreamFailed(f"HTTP {response.status}")
            if response.status in (401, 403):
                # The engine refused the gateway's engine key (vLLM: 401
                # {"error":"Unauthorized"}): the platform's fault, not the client's.
                raise UpstreamFailed(
                    f"HTTP {response.status}: the replica refused the engine API key"
                )
            try:
                body = await response.read()
            except (TimeoutError, OSError) as exc:
                raise UpstreamFailed(type(exc).__name__) from None
            raise upstream_client_error(response.status, body)
        finally:
            response.close()

    async def _end_broken(
        self,
        plan: ChatPlan,
        replica_id: str,
        send: Send,
        before_last_send: Callable[[], None],
    ) -> None:
        """Tell the client its answer broke after tokens were sent (no retry then)."""
        if not plan.stream:
            raise GatewayError(
                502,
                "the replica failed while answering; the answer is incomplete",
                code="upstream_failed",
                error_type="server_error",
            )
        before_last_send()
        try:
            await send(
                {
                    "type": "http.response.body",
                    "body": stream_error_event(replica_id=replica_id),
                    "more_body": False,
                }
            )
        except Exception as exc:  # the client may be gone already
            logger.info("could not send the stream's error event: %r", exc)

    # -- metering ---------------------------------------------------------------------

    def _meter(self, plan: ChatPlan, served: _Served, usage: FinalUsage | None) -> None:
        """Meter the request once, whatever happened (disconnects included)."""
        model, version = plan.resolution.model, plan.resolution.version
        first_token_at = served.first_token_at
        metrics.observe_request(
            model=model,
            version=version,
            region=self.settings.region,
            team=plan.team,
            outcome=served.outcome,
            ttft_s=(first_token_at - plan.started_at) if first_token_at else None,
            duration_s=time.monotonic() - plan.started_at,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            output_tokens=usage.completion_tokens if usage else 0,
        )
        if served.figure_role is not None and self.figures is not None:
            figures = self._figures(plan, served, usage)
            if figures is not None:
                self.background.spawn(
                    self.figures.add(
                        FigureKey.from_time(
                            model,
                            version,
                            served.figure_role,
                            time.time(),
                            self.settings.figures_bucket_s,
                        ),
                        figures,
                        plan.routing_key,
                    )
                )
        if usage is None:
            return
        # Batch work (the batch tier, or a batch job's key at any tier) is counted
        # in the totals and again in its own part: a batch token is a team token.
        is_batch = plan.is_batch_work
        counts = UsageCounts(
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=min(usage.cached_tokens, usage.prompt_tokens),
            output_tokens=usage.completion_tokens,
            requests=1,
            batch_requests=1 if is_batch else 0,
            batch_prompt_tokens=usage.prompt_tokens if is_batch else 0,
            batch_output_tokens=usage.completion_tokens if is_batch else 0,
        )
        self.background.spawn(
            self.usage_counter.add(
                UsageKey.from_time(plan.team, model, version, time.time()), counts
            )
        )

    def _figures(
        self, plan: ChatPlan, served: _Served, usage: FinalUsage | None
    ) -> VersionFigures | None:
        """Return the request's figures for the guards; None for a client's 4xx.

        A complete answer counts its output tokens and whether it opens with a
        refusal; a client that left counts as a request with neither an answer
        nor an error; anything else is an error of the version, by kind.
        """
        first_token_at = served.first_token_at
        ttft = (first_token_at - plan.started_at) if first_token_at else None
        if served.outcome == "ok" and usage is not None:
            relay = served.relay
            text = relay.head_text() if relay is not None else ""
            return one_request(
                ttft_s=ttft,
                output_tokens=usage.completion_tokens,
                refused=self.refusals.is_refusal(text),
            )
        if served.outcome == "client_closed":
            return one_request(ttft_s=ttft, output_tokens=None)
        if served.is_client_error and served.error_kind is None:
            return None
        return one_request(
            ttft_s=ttft, output_tokens=None, error_kind=served.error_kind or "error"
        )


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("background task failed: %r", task.exception())
