"""One planned chat request, served: admitted, routed, relayed, metered, given back.

Public surface: ``ChatService``, ``BackgroundTasks``, ``UsageCounter``.

The steps (seed steps 6-9 and 12), each taking what the one before produced:

1. admission (``routing.admission``) turns the ``ChatPlan`` into a ``Ticket`` or a
   429/503 with Retry-After (jittered, so refused clients do not all return at
   once); a shadow copy goes out if the plan's resolution names one, and a
   sampled candidate request's pair goes to the plan's judge
   (``routing.live_judge``);
2. the pool's routing policy orders the replicas for the routing key; each try is
   an ``Attempt`` (``routing.attempt``) that returns what happened; on a connect
   error, a 5xx or no first token within ``first_token_timeout_s`` the next one is
   tried, within the pool's retry budget, unseen by the client; the replica that
   failed is ejected for the missed-beat window; a large embeddings request may
   instead be split into chunks sent at once to idle replicas, each with its own
   failover, and answered merged (``routing.domain.embedding_split`` decides);
3. the attempt's ``Relay`` forwards the engine's events; the answer ends with the
   final event (``routing.responses``), or with an error event after a mid-stream
   failure (the replica died, or was silent for ``inter_token_timeout_s``; it is
   ejected too);
4. the request is metered once, from one immutable record (``Served``, a client
   that left included), by ``routing.request_meter``: the refund, the metrics,
   the usage row (batch work in its own part too) and, for a model under rollout
   (a canary or a shadow set), its version's figures (``metering.figures``: role
   live or canary, pinned requests left out; role chosen here).

The request's tokens in flight on its replica are counted in ``LiveLoad`` while it
streams (prompt plus remaining output), so routing sees them at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence

from config.asgi_io import ChunkedWrite, Message, Send
from metering import metrics
from metering.domain.figures import Role
from metering.figures import FigureRecorder
from routing.admission import Admission
from routing.attempt import Attempt, AttemptResult, Cut, NoFirstToken
from routing.background import BackgroundTasks
from routing.budgets import BudgetGuard
from routing.domain.admission_control import AdmissionRequest, Rejected, Ticket
from routing.domain.embedding_split import DEFAULT_SPLIT_RULE, split_inputs
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
from routing.embeddings import (
    EngineEmbeddings,
    embedding_answer,
    merge_embeddings,
    split_plan,
)
from routing.kv_subscriber import KVEventSubscriber
from routing.live import LiveLoad
from routing.live_judge import LiveJudge
from routing.plan import ChatPlan, GatewaySettings, payload_for
from routing.relay import UpstreamFailed
from routing.request_meter import RequestMeter, Served, UsageCounter
from routing.responses import FinalUsage, GatewayError
from routing.shadow import Shadow
from routing.sticky import ConversationVersions
from routing.traces import NO_TRACE, RequestTrace
from routing.traffic import TrafficRecorder
from routing.upstream import Upstream

logger = logging.getLogger(__name__)

__all__ = ["BackgroundTasks", "ChatService", "UsageCounter"]

_DEFAULT_POLICY = "prefix_affinity"
# An embedding model's: its inputs share no prefix cache worth keeping warm, so
# the least loaded replica (tokens in flight) serves best.
_EMBEDDING_POLICY = "least_tokens"


@dataclasses.dataclass(frozen=True, slots=True)
class _Answer:
    """Where one request's answer goes: the client's send and the server's hooks."""

    send: Send
    before_last_send: Callable[[], None]
    write_frames: ChunkedWrite | None


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
        budgets: BudgetGuard | None = None,
        traffic: TrafficRecorder | None = None,
    ) -> None:
        self.settings = settings
        self.traffic = traffic
        self.live = live
        self.admission = admission
        self.upstream = upstream
        self.background = background
        self.rng = rng
        self.figures = figures
        self.conversations = conversations
        # The replicas' KV events and the pools' prefix indexes (cache-aware
        # routing); kept in step with the snapshot by the gateway's exchange.
        self.kv_events = KVEventSubscriber()
        refusals = RefusalDetector(settings.refusal_patterns)
        self.meter = RequestMeter(
            region=settings.region,
            figures_bucket_s=settings.figures_bucket_s,
            admission=admission,
            usage_counter=usage_counter,
            background=background,
            refusals=refusals,
            figures=figures,
            budgets=budgets,
        )
        self.shadow = Shadow(
            live=live,
            upstream=upstream,
            region=settings.region,
            concurrency=settings.shadow_concurrency,
            figures=figures,
            detector=refusals,
            bucket_s=settings.figures_bucket_s,
        )
        self.live_judge = LiveJudge(
            live=live,
            upstream=upstream,
            region=settings.region,
            concurrency=settings.shadow_concurrency,
            figures=figures,
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
        trace: RequestTrace = NO_TRACE,
    ) -> None:
        """Answer ``plan`` on ``send``, its steps' spans in ``trace``.

        ``write_frames``: the server's write of chunk frames to the client
        (``config.http_protocol``), which the relay uses where it can.

        ``before_last_send`` is called just before the message that completes the
        answer: after it the server reports the client gone, which must no longer
        cancel the refund and metering that follow.

        Raises:
            GatewayError: refused before any byte of the answer was sent.
        """
        plan, remembered = await self._remember(plan, snapshot)
        # The team's USD budgets: its worst case held until the meter settles it.
        reservation = await self.meter.reserve(plan, snapshot)
        try:
            with trace.admission(plan, self.settings.region):
                ticket = await self._admit(plan)
        except BaseException:
            await self.meter.cancel(reservation)
            raise
        role = self._figure_role(plan, snapshot, remembered)
        for copy in (
            self.shadow.offer(plan, snapshot, trace),
            self.live_judge.offer(plan, snapshot, role, trace, draw=self.rng.random()),
        ):
            if copy is not None:  # off the caller's path, never raising
                self.background.spawn(copy)
        cause: BaseException | None = None
        try:
            ended = await self._route(
                plan,
                snapshot,
                ticket,
                role,
                _Answer(send, before_last_send, write_frames),
                trace,
            )
        except Cut as cut:
            ended, cause = cut.so_far, cut.cause
        except BaseException as exc:  # cut short outside any attempt
            outcome: metrics.Outcome = (
                "client_closed" if isinstance(exc, asyncio.CancelledError) else "error"
            )
            ended, cause = AttemptResult(outcome), exc
        await self.meter.settle(Served(plan, ticket, role, ended, reservation))
        if self.traffic is not None:  # the traffic twin: kept, flushed later
            self.traffic.offer(plan, snapshot, ended)
        trace.served(ended)
        # Raised outside the handlers above, so that each keeps its own context.
        if cause is not None:
            raise cause
        if ended.error is not None:
            raise ended.error

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
                    max_tokens=plan.output_claim,
                    limit=plan.limit,
                )
            )
        except Rejected as exc:
            raise self.meter.refusal(exc, plan, self.rng) from None
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

    # -- routing ----------------------------------------------------------------------

    def _policy(
        self, snapshot: ConfigSnapshot, model: str, version: str
    ) -> RoutingPolicy:
        """Return the pool's policy, built anew if the model's policy changed."""
        record = snapshot.models.get(model)
        if record is None:
            name = _DEFAULT_POLICY
        else:
            name = _EMBEDDING_POLICY if record.is_embedding else record.policy
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
        ticket: Ticket,
        role: Role | None,
        answer: _Answer,
        trace: RequestTrace = NO_TRACE,
    ) -> AttemptResult:
        """Try the pool's replicas in the policy's order; return how it ended.

        Raises:
            Cut: an attempt was cut short after it began.
        """
        model, version = plan.resolution.model, plan.resolution.version
        policy = self._policy(snapshot, model, version)
        budget = self._budget((model, version))
        now = time.monotonic()
        budget.record_request(now)
        nodes = self.live.nodes(snapshot, model, version, now)
        cached = (
            self.kv_events.cached_tokens(
                model, version, plan.prompt_ids, plan.prompt_tokens
            )
            if plan.prompt_ids
            else None
        )
        decision = policy.choose(
            RouteRequest(
                model=model,
                version=version,
                routing_key=plan.routing_key,
                team=plan.team,
                request_tokens=plan.request_tokens,
                prompt_tokens=plan.prompt_tokens,
                cached_tokens=cached,
            ),
            nodes,
            now,
        )
        trace.routed(decision, len(nodes), started_at=now)
        urls = {node.replica_id: node.url for node in nodes}
        settings = self.settings
        if plan.surface == "embeddings":
            idle = {
                node.replica_id
                for node in nodes
                if node.tokens_in_flight == 0 and node.queue_depth == 0
            }
            chunks = split_inputs(plan.input_tokens, len(idle), DEFAULT_SPLIT_RULE)
            if len(chunks) > 1:
                # Idle replicas first, least loaded first: chunk i goes to the
                # i-th, and fails over to the others in the same order.
                order = [r for r in decision.candidates if r in idle] + [
                    r for r in decision.candidates if r not in idle
                ]
                return await self._split(
                    _Split(plan, chunks, order, urls, ticket.headers, budget, trace),
                    answer,
                )
        timed_out = False
        failures: list[str] = []
        is_budget_spent = False
        is_stall = False
        for attempt, replica_id in enumerate(decision.candidates):
            if attempt > 0:
                # Moving off a replica judged stalled is not a retry storm: that
                # replica's fault, not the pool's load, so the budget is not asked.
                if not is_stall and not budget.try_spend(time.monotonic()):
                    is_budget_spent = True
                    break
                metrics.count_retry(
                    model=model, version=version, region=settings.region
                )
            try:
                attempted = Attempt(
                    plan=plan,
                    replica_id=replica_id,
                    url=urls[replica_id],
                    region=settings.region,
                    rate_limit=ticket.headers,
                    first_token_timeout_s=settings.first_token_timeout_s,
                    live=self.live,
                    upstream=self.upstream,
                    send=answer.send,
                    before_last_send=answer.before_last_send,
                    write_frames=answer.write_frames,
                    # Only answers the rollout guards judge keep their head.
                    capture_head=role is not None,
                    prefill_tokens=plan.prompt_tokens
                    - (cached.get(replica_id, 0) if cached else 0),
                )
                return await trace.attempt(attempted, decision, attempt)
            except UpstreamFailed as exc:
                logger.warning(
                    "replica %s failed before the first token: %s", replica_id, exc
                )
                self.live.eject(replica_id, time.monotonic())
                timed_out = isinstance(exc, NoFirstToken)
                is_stall = exc.is_stall
                failures.append(f"{replica_id}: {exc}")
        # No replica could start an answer: an error of the version all the same.
        return AttemptResult(
            "error",
            error_kind="timeout" if timed_out else "upstream",
            error=_no_answer_error(
                f"{model}@{version}",
                failures,
                is_budget_spent=is_budget_spent,
                retry_after_s=1 + self.rng.randint(0, 2),
            ),
        )

    async def _split(self, split: _Split, answer: _Answer) -> AttemptResult:
        """Send an embeddings request's chunks at once, each to its replica (with
        failover), and answer their merged answers; return how it ended.

        Each chunk that was answered counts in the usage, whether the request
        ends well or not: the engines did that work. A chunk no replica could
        answer (or refused: a 4xx) fails the whole request with its error.

        Raises:
            Cut: cut short (the client left, or a bug) after the chunks began.
        """
        plan = split.plan
        tasks = [
            asyncio.ensure_future(self._chunk(split, index))
            for index in range(len(split.chunks))
        ]
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError as exc:
            for task in tasks:
                task.cancel()
            raise Cut(_split_result(tasks, "client_closed", split), exc) from None
        errors = [e for task in tasks if (e := task.exception()) is not None]
        refusals = [e for e in errors if isinstance(e, GatewayError)]
        if len(refusals) < len(errors):  # a bug: metered, then raised
            unexpected = next(e for e in errors if not isinstance(e, GatewayError))
            raise Cut(_split_result(tasks, "error", split), unexpected)
        if refusals:
            # The client's own 4xx before a 503 of the pool.
            failed = min(refusals, key=lambda e: e.status)
            return dataclasses.replace(
                _split_result(tasks, "error", split),
                error_kind=None if failed.status < 500 else "upstream",
                error=failed,
            )
        parts = [task.result() for task in tasks]
        replica_ids = [replica_id for replica_id, _ in parts]
        try:
            merged = merge_embeddings([engine for _, engine in parts], split.chunks)
        except ValueError:
            return dataclasses.replace(
                _split_result(tasks, "error", split),
                error_kind="upstream",
                error=GatewayError(
                    502,
                    "a replica's answer to part of the inputs was malformed",
                    code="upstream_failed",
                    error_type="server_error",
                ),
            )
        body, answer_id = embedding_answer(
            merged, plan=plan, region=self.settings.region, replica_ids=replica_ids
        )
        result = AttemptResult(
            "ok", replica_ids[0], first_token_at=time.monotonic(), usage=merged.usage
        )
        await self._attempt(split, plan, replica_ids[0], answer).send_whole(
            result, body, answer_id
        )
        return result

    async def _chunk(self, split: _Split, index: int) -> tuple[str, EngineEmbeddings]:
        """Return the replica that answered chunk ``index`` and its answer: the
        chunk's own replica first, then the others within the retry budget.

        Raises:
            GatewayError: a 4xx the chunk caused, or no replica answered it.
        """
        plan = split_plan(split.plan, split.chunks[index])
        own = split.replicas[index]
        order = [own, *(r for r in split.replicas if r != own)]
        model, version = plan.resolution.model, plan.resolution.version
        failures: list[str] = []
        is_budget_spent = False
        for attempt, replica_id in enumerate(order):
            if attempt > 0:
                if not split.budget.try_spend(time.monotonic()):
                    is_budget_spent = True
                    break
                metrics.count_retry(
                    model=model, version=version, region=self.settings.region
                )
            try:
                engine = await split.trace.fetch_chunk(
                    self._attempt(split, plan, replica_id, None),
                    chunk=index,
                    index=attempt,
                )
            except UpstreamFailed as exc:
                logger.warning("replica %s failed a chunk: %s", replica_id, exc)
                self.live.eject(replica_id, time.monotonic())
                failures.append(f"{replica_id}: {exc}")
                continue
            return replica_id, engine
        raise _no_answer_error(
            f"{model}@{version}",
            failures,
            is_budget_spent=is_budget_spent,
            retry_after_s=1 + self.rng.randint(0, 2),
        )

    def _attempt(
        self, split: _Split, plan: ChatPlan, replica_id: str, answer: _Answer | None
    ) -> Attempt:
        """Return an attempt of (part of) a split request at ``replica_id``;
        without ``answer`` it may only fetch."""
        return Attempt(
            plan=plan,
            replica_id=replica_id,
            url=split.urls[replica_id],
            region=self.settings.region,
            rate_limit=split.rate_limit,
            first_token_timeout_s=self.settings.first_token_timeout_s,
            live=self.live,
            upstream=self.upstream,
            send=answer.send if answer else _no_send,
            before_last_send=answer.before_last_send if answer else _no_hook,
            write_frames=None,
            capture_head=False,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _Split:
    """An embeddings request split across replicas: its chunks of inputs, the
    replicas in the order the chunks take them, and what each attempt needs."""

    plan: ChatPlan
    chunks: list[range]
    replicas: list[str]
    urls: dict[str, str]
    rate_limit: dict[str, str]
    budget: RetryBudget
    trace: RequestTrace


def _split_result(
    tasks: Sequence[asyncio.Future[tuple[str, EngineEmbeddings]]],
    outcome: metrics.Outcome,
    split: _Split,
) -> AttemptResult:
    """Return what a split served so far: the usage of its chunks answered."""
    answered = [
        task.result()
        for task in tasks
        if task.done() and not task.cancelled() and task.exception() is None
    ]
    usage = None
    if answered:
        usage = FinalUsage(
            prompt_tokens=sum(engine.usage.prompt_tokens for _, engine in answered),
            cached_tokens=0,
            completion_tokens=0,
        )
    replica_id = answered[0][0] if answered else split.replicas[0]
    return AttemptResult(outcome, replica_id, usage=usage)


async def _no_send(message: Message) -> None:
    raise RuntimeError("a chunk's attempt sends nothing")


def _no_hook() -> None:
    return None


def _no_answer_error(
    pool: str, failures: list[str], *, is_budget_spent: bool, retry_after_s: int
) -> GatewayError:
    """The 503 when no replica started an answer, naming why (issue 32: a stall
    answered "no replica available" while a healthy replica served others)."""
    headers = {"retry-after": str(retry_after_s)}
    if is_budget_spent:
        return GatewayError(
            503,
            f"replica {failures[-1]} (before its first token), and {pool}'s retry "
            "budget is spent: too many requests were retried in the last minute",
            code="retry_budget_exhausted",
            headers=headers,
        )
    if failures:
        return GatewayError(
            503,
            f"every replica of {pool} tried failed before its first token "
            f"({'; '.join(failures)})",
            code="no_replica_available",
            headers=headers,
        )
    return GatewayError(
        503,
        f"no replica of {pool} can serve right now (none serving)",
        code="no_replica_available",
        headers=headers,
    )
