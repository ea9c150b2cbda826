"""The fleet simulator: the platform's own decisions over modelled replicas, in
virtual time.

Public surface: ``FleetPool`` (from ``drills.domain.fleet_pool``), ``FleetSim``
(configured by ``drills.domain.fleet_config``, measured in
``drills.domain.fleet_result``), ``RequestSource``.

What runs is the gateway's decision code, not a copy of it:

- routing: ``routing.domain.policies.make_policy(name, options)`` (round robin,
  least tokens in flight, prefix affinity with bounded load, cache aware), called
  with the same
  ``RouteRequest`` and ``NodeSnapshot`` objects the gateway builds, one policy
  instance per pool, the conversation id as routing key;
- admission: ``routing.domain.admission_control.AdmissionControl``, the gateway's
  own sequence (team token bucket charged prompt + ``max_tokens`` and a
  ``max_concurrency`` slot taken together, the pool's tiered queue, refunds of what
  was not used), its effects performed here on ``routing.domain.limit_table``
  (the gateway's in-memory limits) in virtual time; a queued request's sequence is
  resumed by the pump, which runs when an answer ends and on a short tick, as the
  gateway's does; the pool's capacity is
  ``models_registry.domain.capacity.pool_capacity_tokens``;
- failures: ``routing.domain.retry_budget.RetryBudget`` (a request that lost its
  replica before its first token is retried on the next candidate within the
  budget; one that had tokens ends with an error and is metered for them);
- autoscaling (``FleetConfig.autoscaling``): ``models_registry.domain.autoscaler.
  decide`` every 5 s, the live task's policy, and the live reconcile's
  convergence (``engine_nodes.domain.convergence.converge_steps``, its effects
  performed here: starts, cancels, one drain at a time); new replicas join the
  ring after a cold or warm start (``drills.domain.fleet_scaling``).

- cache-aware routing (``FleetConfig.has_kv_index``): the replicas publish KV
  events once per step, which reach the gateway's ``routing.domain.kv_index.
  PrefixIndex`` ``kv_event_delay_s`` later (a ZMQ hop and the gateway's loop); a
  request's synthetic block hashes (``FleetRequest.block_hashes``) are matched
  against it for ``RouteRequest.cached_tokens``, and each replica's
  ``prefill_tokens_in_flight`` is the gateway's own count: a request's prompt less
  its predicted hit from routing to its first token (or its end). A replica that
  leaves the ring is forgotten by the index.

Replicas are ``drills.domain.replica.FleetReplica`` (the engine's step-time model
and vLLM's block pool, or SGLang's radix cache with ``FleetConfig.engine``
"sglang", advanced a segment of steps at a time). Everything is
deterministic for a seed: one ``random.Random`` per replica and one per team for
its arrivals (``drills.domain.fleet_arrivals``: one team's surge leaves the others'
requests unchanged), and a
heap of events ordered by (time, kind, sequence).

The extension point for a drill's own client (``RequestSource``, given as
``FleetSim(..., sources=...)``): a source is ticked in virtual time, sends requests
through ``send`` (admitted, routed and served like the workload's, and measured
with them) and is told how each ended, with the refusal's Retry-After, so it can
run a client's own policy (``drills.domain.batch_drill``: the batch scheduler).
Without sources nothing of it runs: its events sort after all others.

Simplifications, each a modelling choice rather than a second policy: one gateway
with exact, live load per replica (real gateways share their shares through Redis
every second); a lost replica leaves the ring at once (the gateway ejects a replica
on its first failed connect); no client retries after a 429 or 503.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, cast

from drills.domain.fleet_arrivals import TeamArrivals
from drills.domain.fleet_config import FleetConfig, FleetEvent
from drills.domain.fleet_pool import FleetPool
from drills.domain.fleet_result import FleetResult, Sample
from drills.domain.fleet_scaling import FleetScaler
from drills.domain.replica import FleetReplica, FleetRequest
from drills.domain.workload import (
    Arrival,
    ChatWorkload,
    TeamSpec,
    convert_block_keys,
)
from engine_nodes.domain.convergence import (
    CancelReplica,
    Effect,
    ReplicaView,
    StartReplica,
    converge_steps,
)
from engine_nodes.domain.liveness import ReplicaState
from routing.domain.admission import Outcome, Verdict
from routing.domain.admission_control import (
    AdmissionControl,
    AdmissionRequest,
    ChargeAndAcquire,
    RefundAndRelease,
    Rejected,
    ShedWaiting,
    Steps,
    Ticket,
)
from routing.domain.kv_index import PrefixIndex
from routing.domain.limit_table import BucketTable, Claim, LimitTable, SlotTable
from routing.domain.limiter import ChargeTooLarge
from routing.domain.policies import (
    RouteRequest,
    make_policy,
)
from routing.domain.retry_budget import RetryBudget
from routing.domain.snapshot import LimitRecord, NodeSnapshot
from routing.domain.tiers import Tier
from simengine.domain.kv_events import EventBatch

__all__ = ["FleetPool", "FleetSim", "RequestSource"]

_MODEL, _VERSION = "chat-7b", "v1"
_POOL = (_MODEL, _VERSION)
# A team without a token limit or a concurrency cap (0 in its TeamSpec) gets a
# bucket and a cap no request can reach, so it runs the same sequence as others.
_NO_TOKEN_LIMIT = 10**12
_NO_CONCURRENCY_CAP = 10**9
# What the simulator calls a refused request, by the refusal's status.
_REFUSED = {400: "too_large", 429: "rate_limited", 503: "shed"}
# Event kinds, in the order simultaneous events run (then by sequence).
# Autoscaling's two come last, then the request sources' two, so a run without
# them keeps its order exactly.
(
    _WAKE,
    _READY,
    _SCENARIO,
    _ARRIVAL,
    _PUMP,
    _SAMPLE,
    _SCALE,
    _DRAIN_END,
    _SOURCE_TICK,
    _SOURCE_SENT,
    _ROUTE_AGAIN,
    _ROUTE_FIRST,
) = range(12)
# How often a request waiting for its warm replica (``FleetConfig.owner_wait_s``)
# looks again.
_OWNER_POLL_S = 0.025
_PUMP_S = 0.05  # the admission queue's tick while anything waits (as the gateway)


class RequestSource(Protocol):
    """A drill's own client beside the workload: the simulator's extension point.

    ``tick(now, send)`` is called at 0 s and then at each time it returns (None:
    no more ticks; a time must lie after ``now``). ``send(arrival)`` injects a
    request at ``now`` (``arrival.at`` is ignored) and returns it; its admission
    runs just after the tick returns, so the source knows every request before any
    outcome. ``ended(request, retry_after_s)`` is called once when one of its
    requests ends (``request.outcome``: ``"ok"`` or a refusal or error of
    ``drills.domain.fleet_result.OUTCOMES``; ``retry_after_s``: the refusal's
    Retry-After for a 429 or 503, else None). Requests still running when the run
    stops get no call.
    """

    def tick(
        self, now: float, send: Callable[[Arrival], FleetRequest]
    ) -> float | None: ...

    def ended(self, request: FleetRequest, retry_after_s: float | None) -> None: ...


class FleetSim:
    """One pool of replicas behind one gateway, fed by a workload or a trace, and
    by any ``RequestSource``."""

    def __init__(
        self,
        config: FleetConfig,
        workload: ChatWorkload | None = None,
        *,
        arrivals: Iterable[Arrival] | None = None,
        events: Iterable[FleetEvent] = (),
        teams: Iterable[TeamSpec] = (),
        sources: Iterable[RequestSource] = (),
    ) -> None:
        if (workload is None) == (arrivals is None):
            raise ValueError("give a workload or a stream of arrivals, not both")
        self.config = config
        self.workload = workload
        profile = config.perf_profile
        self.profile = profile
        self._host_blocks = config.host_blocks
        self._owner_waits: dict[int, float] = {}  # request id -> waiting since
        self.policy = make_policy(config.policy, config.policy_options)
        self.budget = RetryBudget(
            ratio=config.retry_ratio, min_retries=config.retry_min
        )
        team_list = list(workload.teams if workload is not None else ()) + list(teams)
        self.teams: dict[str, TeamSpec] = {team.name: team for team in team_list}
        self.replicas: dict[str, FleetReplica] = {}
        self._created: dict[str, float] = {}
        # ``FleetConfig.follow_placement``: replica ids in order of creation, the
        # recorded replicas in order of first appearance, and each request's.
        self._creation_order: list[str] = []
        self._recorded_order: dict[str, int] = {}
        self._recorded_replica: dict[int, str] = {}
        self.serving: list[FleetReplica] = []
        self.pool = FleetPool(
            self.serving,
            replica_tokens_in_flight=config.replica_tokens_in_flight,
            is_tiered=config.admission,
        )
        self.admission = AdmissionControl(self.pool, config.admission_options)
        self.limits = LimitTable(BucketTable(), SlotTable())
        self._team_limits: dict[str, LimitRecord] = {}
        self._replica_count = 0
        for _ in range(config.replicas):
            self._serve(self._new_replica())
        # The autoscaler's bookkeeping (drills.domain.fleet_scaling), and the
        # replicas out of the ring that still run streams.
        self.scaler = (
            FleetScaler(
                config.autoscaling,
                replica_tokens_in_flight=config.replica_tokens_in_flight,
                gpus_per_replica=profile.gpus,
                replicas=[replica.replica_id for replica in self.serving],
            )
            if config.autoscaling is not None
            else None
        )
        self._draining: dict[str, FleetReplica] = {}
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._wake_version: dict[str, int] = {}
        self._events = sorted(events, key=lambda e: e.at)
        # Requests waiting in the admission queue, and their paused sequences.
        self._queued: dict[str, tuple[FleetRequest, Steps]] = {}
        self._tickets: dict[int, Ticket] = {}  # admitted, by request id
        self._pump_scheduled = False
        self._next_request_id = 0
        self._arrivals = (
            TeamArrivals(workload, config.seed) if workload is not None else None
        )
        self._trace: Iterator[Arrival] | None = (
            iter(arrivals) if arrivals is not None else None
        )
        # The gateway's prefix index (None: no KV events), the batches on their
        # way to it (visible at, replica, its sequence number, batch), and each
        # replica's prefill owed: the gateway's count, by request and in total.
        self.kv_index: PrefixIndex | None = (
            PrefixIndex() if config.has_kv_index else None
        )
        self._kv_in_transit: deque[tuple[float, str, int, EventBatch]] = deque()
        self._kv_seq: dict[str, int] = {}
        self._prefill_owed: dict[int, tuple[str, int]] = {}
        self._prefill_in_flight: dict[str, int] = {}
        self._uses_cache = config.policy == "cache_aware"
        self._sources = list(sources)
        self._owners: dict[int, RequestSource] = {}  # a source's requests, by id
        self.now = 0.0
        self._window: tuple[float, float] = (0.0, math.inf)
        self._result: FleetResult | None = None

    # -- running -----------------------------------------------------------------------

    def run(
        self, duration_s: float, *, warmup_s: float = 0.0, drain_s: float = 120.0
    ) -> FleetResult:
        """Simulate ``warmup_s + duration_s`` seconds and measure the last
        ``duration_s``: the requests that arrive in it, the tokens made in it, the
        samples taken in it. Traffic goes on for up to ``drain_s`` more, until every
        measured request has ended; any still running then is ``unfinished``."""
        if duration_s <= 0 or warmup_s < 0 or drain_s < 0:
            raise ValueError(
                "duration_s must be positive, warmup_s and drain_s not negative"
            )
        end = warmup_s + duration_s
        self._window = (warmup_s, end)
        result = self._result = FleetResult(
            config=self.config,
            started_at=warmup_s,
            ended_at=end,
            block_size=self.config.hit_block_size,
            scaling=self.scaler.log if self.scaler is not None else None,
        )
        if self.scaler is not None:
            self._push(self.scaler.autoscaling.start_tick, _SCALE, None)
        for event in self._events:
            self._push(event.at, _SCENARIO, event)
        if self.workload is not None:
            for team in self.workload.teams:
                self._schedule_arrival(team.name, 0.0)
        else:
            self._next_trace_arrival()
        for source in self._sources:
            self._push(0.0, _SOURCE_TICK, source)
        self._push(warmup_s, _SAMPLE, None)
        counted = False
        generated0 = prefill0 = 0
        measuring = False
        heap = self._heap
        requests = result.requests
        drained = 0  # measured requests known to have ended (a cursor)
        while heap:
            at, kind, _, payload = heap[0]
            if at > end:
                if not counted:
                    counted = True
                    result.generated_tokens = self._generated() - generated0
                    result.prefill_tokens = self._prefilled() - prefill0
                while drained < len(requests) and requests[drained].outcome:
                    drained += 1
                if drained == len(requests) or at > end + drain_s:
                    break
            heapq.heappop(heap)
            if not measuring and at >= warmup_s:
                measuring = True
                generated0 = self._generated()
                prefill0 = self._prefilled()
            self.now = at
            # The payload's type follows from its kind (see _push's callers).
            if kind == _WAKE:
                self._on_wake(cast(tuple[FleetReplica, int], payload))
            elif kind == _ARRIVAL:
                self._on_arrival(cast(Arrival | tuple[str, int], payload))
            elif kind == _PUMP:
                self._pump_scheduled = False
                self._pump()
            elif kind == _SAMPLE:
                self._sample()
                self._push(at + self.config.sample_s, _SAMPLE, None)
            elif kind == _SCENARIO:
                self._on_event(cast(FleetEvent, payload))
            elif kind == _READY:
                replica = cast(FleetReplica, payload)
                if self.scaler is None or self.scaler.joins(replica.replica_id):
                    self._serve(replica)
                    result.events.append((at, f"replica {replica.replica_id} serving"))
            elif kind == _SCALE:
                assert self.scaler is not None
                self._on_scale()
                self._push(self.scaler.autoscaling.next_tick(at), _SCALE, None)
            elif kind == _DRAIN_END:
                self._on_drain_deadline(cast(FleetReplica, payload))
            elif kind == _SOURCE_TICK:
                self._on_source_tick(cast(RequestSource, payload))
            elif kind == _SOURCE_SENT:
                self._admit(cast(FleetRequest, payload))
            elif kind == _ROUTE_AGAIN:
                self._route(cast(FleetRequest, payload), first=False)
            elif kind == _ROUTE_FIRST:
                self._route(cast(FleetRequest, payload), first=True)
        if not counted:
            result.generated_tokens = self._generated() - generated0
            result.prefill_tokens = self._prefilled() - prefill0
        for request in requests:
            if not request.outcome:
                request.outcome = "unfinished"
        return result

    def _push(self, at: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, kind, self._seq, payload))

    # -- replicas ----------------------------------------------------------------------

    def _new_replica(self) -> FleetReplica:
        index = self._replica_count
        self._replica_count += 1
        replica = FleetReplica(
            f"r{index:02d}",
            self.profile,
            block_size=self.config.block_size,
            seed=self.config.seed * 1000 + index,
            jitter_cv=self.config.jitter_cv,
            scheduling=self.config.engine_scheduling,
            host_blocks=self._host_blocks,
            cache=self.config.replica_cache,
            kv_events=self.config.has_kv_index,
            batch_guard=self.config.batch_guard,
        )
        self.replicas[replica.replica_id] = replica
        # The order of creation: convergence's "newest" among equals.
        self._created[replica.replica_id] = float(index)
        self._creation_order.append(replica.replica_id)
        return replica

    def _serve(self, replica: FleetReplica) -> None:
        self.serving.append(replica)
        self.serving.sort(key=lambda r: r.replica_id)

    def _generated(self) -> int:
        return sum(r.generated_tokens for r in self.replicas.values())

    def _prefilled(self) -> int:
        return sum(r.prefill_tokens for r in self.replicas.values())

    def _publish(self, replica: FleetReplica) -> None:
        """Send the replica's KV events of this step toward the gateway's index."""
        events = replica.take_kv_events()
        if events:
            rid = replica.replica_id
            seq = self._kv_seq[rid] = self._kv_seq.get(rid, 0) + 1
            at = self.now + self.config.kv_event_delay_s
            self._kv_in_transit.append((at, rid, seq, EventBatch(self.now, events)))

    def _receive_kv_events(self) -> None:
        """Apply the batches that reached the gateway by now (in order: the delay
        is the same for all), but none of a replica that left the ring."""
        index = self.kv_index
        transit = self._kv_in_transit
        assert index is not None
        now = self.now
        while transit and transit[0][0] <= now:
            _, rid, seq, batch = transit.popleft()
            if self.replicas[rid] in self.serving:
                index.apply(rid, seq, batch, now)

    def _prefill_started(self, request: FleetRequest, rid: str, owed: int) -> None:
        self._prefill_owed[request.request_id] = (rid, owed)
        self._prefill_in_flight[rid] = self._prefill_in_flight.get(rid, 0) + owed

    def _prefill_done(self, request: FleetRequest) -> None:
        """The request's first token came (or it ended): its prefill is no longer
        owed."""
        owed = self._prefill_owed.pop(request.request_id, None)
        if owed is not None:
            rid, tokens = owed
            self._prefill_in_flight[rid] -= tokens

    def _leave_index(self, replica: FleetReplica) -> None:
        """The replica left the ring: the index forgets it."""
        if self.kv_index is not None:
            self.kv_index.forget(replica.replica_id)

    def _kick(self, replica: FleetReplica) -> None:
        """Make ``replica`` notice new work: plan if idle, else cut its segment."""
        if replica.segment is None:
            end = replica.plan(self.now)
            if self.kv_index is not None:
                self._publish(replica)
        else:
            end = replica.interrupt(self.now)
        if end is not None:
            version = self._wake_version.get(replica.replica_id, 0) + 1
            self._wake_version[replica.replica_id] = version
            self._push(end, _WAKE, (replica, version))

    def _on_wake(self, payload: tuple[FleetReplica, int]) -> None:
        replica, version = payload
        if not replica.alive or self._wake_version.get(replica.replica_id) != version:
            return
        first, finished = replica.complete(self.now)
        if self._prefill_owed:
            for request in first:
                self._prefill_done(request)
        for request in finished:
            request.outcome = "ok"
            self._give_back(request, used=request.prompt_tokens + request.output_tokens)
            if self._owners:
                self._tell_source(request, None)
        end = replica.plan(self.now)
        if self.kv_index is not None:
            self._publish(replica)  # one batch per step, as vLLM publishes
        if end is not None:
            self._wake_version[replica.replica_id] = version + 1
            self._push(end, _WAKE, (replica, version + 1))
        elif replica.replica_id in self._draining:
            self._stop(replica)  # its last stream ended
        if finished and self._queued:
            self._pump()

    # -- arrivals ----------------------------------------------------------------------

    def _schedule_arrival(self, team: str, after: float) -> None:
        assert self._arrivals is not None
        drawn = self._arrivals.next_at(self.teams[team], after)
        if drawn is not None:
            self._push(drawn[0], _ARRIVAL, (team, drawn[1]))

    def _next_trace_arrival(self) -> None:
        assert self._trace is not None
        arrival = next(self._trace, None)
        if arrival is not None:
            self._push(arrival.at, _ARRIVAL, arrival)

    def _on_arrival(self, payload: Arrival | tuple[str, int]) -> None:
        if isinstance(payload, Arrival):
            arrival = payload
            self._next_trace_arrival()
            if arrival.team not in self.teams:
                self.teams[arrival.team] = TeamSpec(arrival.team, tier=arrival.tier)
        else:
            team, version = payload
            assert self._arrivals is not None
            if not self._arrivals.is_current(team, version):
                return  # the team's rate changed; a fresh arrival was drawn
            self._schedule_arrival(team, self.now)
            arrival = self._arrivals.arrival(self.teams[team], self.now)
        self._admit(self._enter(arrival))

    def _enter(self, arrival: Arrival) -> FleetRequest:
        """Make the request of an arrival at ``now``, measured if in the window."""
        self._next_request_id += 1
        request = FleetRequest(
            self._next_request_id,
            team=arrival.team,
            tier=arrival.tier,
            conversation=arrival.conversation,
            prompt_tokens=arrival.prompt_tokens,
            output_tokens=arrival.output_tokens,
            max_tokens=arrival.max_tokens,
            history_tokens=arrival.history_tokens,
            stream_tokens=arrival.stream_tokens,
            arrived_at=self.now,
            prefix_group=arrival.prefix_group,
            prefix_tokens=arrival.prefix_tokens,
            block_keys=convert_block_keys(
                arrival.block_keys, arrival.block_keys_size, self.config.block_size
            ),
        )
        if self.config.follow_placement and arrival.replica:
            self._recorded_order.setdefault(arrival.replica, len(self._recorded_order))
            self._recorded_replica[request.request_id] = arrival.replica
        if self._window[0] <= self.now < self._window[1]:
            assert self._result is not None
            self._result.requests.append(request)
        return request

    # -- request sources ----------------------------------------------------------------

    def _on_source_tick(self, source: RequestSource) -> None:
        def send(arrival: Arrival) -> FleetRequest:
            if arrival.team not in self.teams:
                self.teams[arrival.team] = TeamSpec(arrival.team, tier=arrival.tier)
            request = self._enter(arrival)
            self._owners[request.request_id] = source
            self._push(self.now, _SOURCE_SENT, request)
            return request

        next_at = source.tick(self.now, send)
        if next_at is not None:
            if not next_at > self.now:
                raise ValueError("a request source's next tick must lie after now")
            self._push(next_at, _SOURCE_TICK, source)

    def _tell_source(self, request: FleetRequest, retry_after_s: float | None) -> None:
        source = self._owners.pop(request.request_id, None)
        if source is not None:
            source.ended(request, retry_after_s)

    # -- the gateway's decisions ----------------------------------------------------------

    def _admit(self, request: FleetRequest) -> None:
        """Run the gateway's admission sequence for a request that just arrived."""
        steps = self.admission.admit(
            AdmissionRequest(
                team=request.team,
                model=_MODEL,
                version=_VERSION,
                tier=Tier(request.tier),
                prompt_tokens=request.prompt_tokens,
                max_tokens=request.max_tokens,
                limit=self._limit(request.team),
            ),
            str(request.request_id),
            self.now,
        )
        self._advance(request, steps, None)

    def _advance(
        self, request: FleetRequest, steps: Steps, reply: Claim | Verdict | None
    ) -> None:
        """Perform the sequence's effects until it admits, refuses or waits."""
        error: Exception | None = None
        while True:
            try:
                effect = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                self._tickets[request.request_id] = done.value
                delay = self.config.route_delay_s
                if delay > 0:
                    # Admitted now, its tokens counted; at the replica later.
                    self._push(self.now + delay, _ROUTE_FIRST, request)
                else:
                    self._route(request, first=True)
                return
            except Rejected as refused:
                self._end(
                    request,
                    _REFUSED[refused.status],
                    retry_after_s=refused.retry_after_s,
                )
                return
            reply, error = None, None
            if isinstance(effect, ChargeAndAcquire):
                try:
                    reply = effect.apply(self.limits, self.now)
                except ChargeTooLarge as exc:
                    error = exc
            elif isinstance(effect, RefundAndRelease):
                effect.apply(self.limits, self.now)
            elif isinstance(effect, ShedWaiting):
                for admission_id, retry_after_s in effect.shed:
                    self._wake(admission_id, Verdict(Outcome.SHED, retry_after_s))
            else:  # WaitInQueue: the pump resumes it
                self._queued[effect.admission_id] = (request, steps)
                self._schedule_pump()
                return

    def _wake(self, admission_id: str, verdict: Verdict) -> None:
        request, steps = self._queued.pop(admission_id)
        self._advance(request, steps, verdict)

    def _limit(self, team_name: str) -> LimitRecord:
        limit = self._team_limits.get(team_name)
        if limit is None:
            team = self.teams[team_name]
            limit = self._team_limits[team_name] = LimitRecord(
                team=team.name,
                model=_MODEL,
                tokens_per_minute=team.tokens_per_minute or _NO_TOKEN_LIMIT,
                max_concurrency=team.max_concurrency or _NO_CONCURRENCY_CAP,
                guaranteed_share=team.guaranteed_share,
            )
        return limit

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self._push(self.now + _PUMP_S, _PUMP, None)

    def _pump(self) -> None:
        if not self._queued:
            return
        pumped = self.admission.pump(_POOL, self.now)
        for admission_id, retry_after_s in pumped.shed:
            self._wake(admission_id, Verdict(Outcome.SHED, retry_after_s))
        for admission_id in pumped.admitted:
            self._wake(admission_id, Verdict(Outcome.ADMIT))
        if self._queued:
            self._schedule_pump()

    def _route(self, request: FleetRequest, *, first: bool) -> None:
        now = self.now
        if first:
            self.budget.record_request(now)
        prefill = self._prefill_in_flight
        nodes = [
            NodeSnapshot(
                replica_id=replica.replica_id,
                url="",
                tokens_in_flight=replica.tokens_in_flight(now),
                queue_depth=replica.num_waiting,
                kv_cache_usage_perc=replica.kv_cache_usage_perc,
                prefill_tokens_in_flight=prefill.get(replica.replica_id, 0),
            )
            for replica in self.serving
        ]
        cached: dict[str, int] | None = None
        if self.kv_index is not None:
            self._receive_kv_events()
        if self.kv_index is not None and self._uses_cache:
            block_size = self.config.block_size
            blocks = min(request.stream_tokens, request.prompt_tokens - 1) // block_size
            keys = request.block_hashes(blocks, block_size)
            cached = self.kv_index.match(keys, request.prompt_tokens)
        decision = self.policy.choose(
            RouteRequest(
                model=_MODEL,
                version=_VERSION,
                routing_key=f"conv-{request.conversation}",
                team=request.team,
                request_tokens=request.prompt_tokens + request.max_tokens,
                prompt_tokens=request.prompt_tokens if cached is not None else 0,
                cached_tokens=cached,
            ),
            nodes,
            now,
        )
        if not decision.candidates:
            self._give_back(request, used=0)
            self._end(request, "no_replica")
            return
        wait_s = self.config.owner_wait_s
        if (
            wait_s > 0
            and decision.skipped_over_bound > 0
            and request.request_id not in self._recorded_replica
        ):
            # Its warm replica is over the bound: wait a little for it to drop
            # under, polling, before going elsewhere (an experiment, not the
            # gateway's behaviour). With ``ring_choices`` 1 a skip is ``n``.
            since = self._owner_waits.setdefault(request.request_id, now)
            if now + _OWNER_POLL_S <= since + wait_s:
                self._push(now + _OWNER_POLL_S, _ROUTE_AGAIN, request)
                return
        self._owner_waits.pop(request.request_id, None)
        replica = self._placed(request) or self.replicas[decision.candidates[0]]
        request.routed_at = now
        request.attempts += 1
        if cached is not None:
            hit = cached.get(replica.replica_id, 0)
            self._prefill_started(
                request, replica.replica_id, request.prompt_tokens - hit
            )
        replica.add(request)
        self._kick(replica)

    def _placed(self, request: FleetRequest) -> FleetReplica | None:
        """Return the replica standing for the one that served ``request`` live
        (``FleetConfig.follow_placement``), if it is serving; once per request."""
        recorded = self._recorded_replica.pop(request.request_id, None)
        if recorded is None:
            return None
        k = self._recorded_order[recorded]
        if k >= len(self._creation_order):
            return None
        replica = self.replicas[self._creation_order[k]]
        return replica if replica in self.serving else None

    def _give_back(self, request: FleetRequest, *, used: int) -> None:
        """The answer ended: refund the bucket, free the slot and the pool's tokens."""
        ticket = self._tickets.pop(request.request_id, None)
        if ticket is not None:
            refund = self.admission.release(ticket, used_tokens=used)
            if refund is not None:
                refund.apply(self.limits, self.now)
        if request.finished_at is None:
            request.finished_at = self.now

    def _end(
        self,
        request: FleetRequest,
        outcome: str,
        *,
        retry_after_s: float | None = None,
    ) -> None:
        request.outcome = outcome
        request.finished_at = self.now
        if self._owners:
            self._tell_source(request, retry_after_s)

    # -- scenario events ----------------------------------------------------------------

    def _on_event(self, event: FleetEvent) -> None:
        assert self._result is not None
        if event.kind == "lose_replica":
            for _ in range(event.count):
                victim = self._victim(event.replica)
                if victim is None:
                    break
                self._lose(victim)
                self._result.events.append(
                    (self.now, f"replica {victim.replica_id} lost")
                )
        elif event.kind == "add_replica":
            for _ in range(event.count):
                replica = self._new_replica()
                self._push(self.now + self.config.cold_start_s, _READY, replica)
                self._result.events.append(
                    (self.now, f"replica {replica.replica_id} starting")
                )
        elif event.kind == "rate":
            arrivals = self._arrivals
            if arrivals is not None:
                arrivals.set_factor(event.factor)
                for team in self.teams:
                    if arrivals.has_users(team):
                        self._schedule_arrival(team, self.now)
            self._result.events.append((self.now, f"arrivals x{event.factor:g}"))
        elif event.kind == "team_rate":
            assert event.team is not None
            if self._arrivals is None:
                raise ValueError(f"no team {event.team!r} in the workload")
            self._arrivals.set_team_factor(event.team, event.factor)
            self._schedule_arrival(event.team, self.now)
            self._result.events.append(
                (self.now, f"team {event.team} x{event.factor:g}")
            )

    def _victim(self, replica_id: str | None) -> FleetReplica | None:
        if replica_id is not None:
            replica = self.replicas.get(replica_id)
            return replica if replica in self.serving else None
        if not self.serving:
            return None
        return max(
            self.serving, key=lambda r: (r.tokens_in_flight(self.now), r.replica_id)
        )

    def _lose(self, replica: FleetReplica) -> None:
        self.serving.remove(replica)
        self._leave_index(replica)
        for request in replica.fail(self.now):
            self._prefill_done(request)
            if request.first_token_at is None and self.budget.try_spend(self.now):
                self._route(request, first=False)
                continue
            request.output_tokens = request.tokens_at_failure
            self._give_back(
                request, used=request.prompt_tokens + request.tokens_at_failure
            )
            self._end(request, "error")

    # -- autoscaling -----------------------------------------------------------------------

    def _on_scale(self) -> None:
        """Call the platform's policy and converge to its desired size."""
        scaler = self.scaler
        assert scaler is not None
        decision = scaler.decide(
            self.now,
            serving=len(self.serving),
            tokens_in_flight=self.pool.in_flight,
            queued=self.admission.waiting(_POOL),
        )
        self.converge(decision.desired)

    def replica_views(self) -> list[ReplicaView]:
        """Return the pool as the agent's rows would show it at ``now``: serving
        replicas with their tokens in flight, starts in progress, the draining."""
        now = self.now
        views = [
            ReplicaView(
                replica.replica_id,
                ReplicaState.SERVING,
                tokens_in_flight=replica.tokens_in_flight(now),
                created_at=self._created[replica.replica_id],
            )
            for replica in self.serving
        ]
        if self.scaler is not None:
            views += [
                ReplicaView(replica_id, state, created_at=self._created[replica_id])
                for replica_id, state in self.scaler.unready(now)
            ]
        views += [
            ReplicaView(
                replica_id,
                ReplicaState.DRAINING,
                created_at=self._created[replica_id],
            )
            for replica_id in self._draining
        ]
        return views

    def converge(self, target: int) -> list[Effect]:
        """Move the pool toward ``target`` replicas by the live reconcile's step.

        ``engine_nodes.domain.convergence.converge_steps`` judges
        ``replica_views()``; this performs its effects on the modelled replicas.
        Returns the effects performed, in order.
        """
        scaler = self.scaler
        assert scaler is not None and self._result is not None
        now = self.now
        views = self.replica_views()
        steps = converge_steps(target, views)
        events = self._result.events
        performed: list[Effect] = []
        done: bool | None = None  # the answer to the last effect
        while True:
            try:
                effect = next(steps) if done is None else steps.send(done)
            except StopIteration:
                return performed
            performed.append(effect)
            if isinstance(effect, StartReplica):
                replica = self._new_replica()
                start = scaler.start(replica.replica_id, now)
                self._push(start.ready_at, _READY, replica)
                kind = "warm" if start.is_warm else "cold"
                events.append((now, f"replica {replica.replica_id} starting {kind}"))
            elif isinstance(effect, CancelReplica):
                scaler.cancel(effect.replica_id, now)
                events.append((now, f"replica {effect.replica_id} cancelled"))
            else:
                self._drain(self.replicas[effect.replica_id])
            done = True

    def _drain(self, replica: FleetReplica) -> None:
        """Take ``replica`` out of the ring; it stops when its streams end."""
        assert self.scaler is not None and self._result is not None
        self.serving.remove(replica)
        self._leave_index(replica)
        self._draining[replica.replica_id] = replica
        self.scaler.drain(replica.replica_id, self.now)
        self._result.events.append((self.now, f"replica {replica.replica_id} draining"))
        if replica.segment is None and not replica.holds():
            self._stop(replica)
        else:
            deadline = self.now + self.scaler.autoscaling.drain_deadline_s
            self._push(deadline, _DRAIN_END, replica)

    def _stop(self, replica: FleetReplica, errors: int = 0) -> None:
        assert self.scaler is not None and self._result is not None
        del self._draining[replica.replica_id]
        replica.alive = False
        self.scaler.stop(replica.replica_id, self.now, errors=errors)
        self._result.events.append((self.now, f"replica {replica.replica_id} stopped"))

    def _on_drain_deadline(self, replica: FleetReplica) -> None:
        """The drain deadline passed: what still runs ends with an error."""
        if replica.replica_id not in self._draining:
            return  # it stopped in time
        cut = replica.fail(self.now)
        for request in cut:
            self._prefill_done(request)
            request.output_tokens = request.tokens_at_failure
            self._give_back(
                request, used=request.prompt_tokens + request.tokens_at_failure
            )
            self._end(request, "error")
        self._stop(replica, errors=len(cut))

    # -- sampling ------------------------------------------------------------------------

    def _sample(self) -> None:
        assert self._result is not None
        if not self._window[0] <= self.now <= self._window[1]:
            return
        queued: dict[str, int] = {tier.value: 0 for tier in Tier}
        for request, _steps in self._queued.values():
            queued[request.tier] += 1
        self._result.samples.append(
            Sample(
                at=self.now,
                replicas=len(self.serving),
                tokens_in_flight=[r.tokens_in_flight(self.now) for r in self.serving],
                queued=queued,
                engine_waiting=sum(r.num_waiting for r in self.serving),
            )
        )
