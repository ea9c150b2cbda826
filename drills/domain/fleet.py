"""The fleet simulator: the platform's own decisions over modelled replicas, in
virtual time.

Public surface: ``FleetConfig``, ``FleetEvent``, ``FleetSim``, ``FleetResult``,
``percentile``.

What runs is the gateway's decision code, not a copy of it:

- routing: ``routing.domain.policies.make_policy(name)`` (round robin, least tokens
  in flight, prefix affinity with bounded load), called with the same
  ``RouteRequest`` and ``NodeSnapshot`` objects the gateway builds, one policy
  instance per pool, the conversation id as routing key;
- token limits: ``routing.domain.limiter.charge`` / ``refund`` per team, charging
  prompt + ``max_tokens`` and refunding what was not generated, and the team's
  ``max_concurrency`` streams (a request without a slot is refused uncharged, as
  ``routing.limits.TieredAdmission``);
- tiers and overload: ``routing.domain.admission.AdmissionQueue`` with the pool's
  capacity from ``models_registry.domain.capacity.pool_capacity_tokens``, pumped
  when an answer ends and on a short tick, as ``routing.limits.TieredAdmission``;
- failures: ``routing.domain.retry_budget.RetryBudget`` (a request that lost its
  replica before its first token is retried on the next candidate within the
  budget; one that had tokens ends with an error and is metered for them).

Replicas are ``drills.domain.replica.FleetReplica`` (the engine's step-time model
and vLLM's block pool, advanced a segment of steps at a time). Everything is
deterministic for a seed: one ``random.Random`` per replica and one per team for
its arrivals (so one team's surge leaves the others' requests unchanged), and a
heap of events ordered by (time, kind, sequence).

Simplifications, each a modelling choice rather than a second policy: one gateway
with exact, live load per replica (real gateways share their shares through Redis
every second); a lost replica leaves the ring at once (the gateway ejects a replica
on its first failed connect); no client retries after a 429 or 503.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from drills.domain.isolation import percentile
from drills.domain.replica import FleetReplica, FleetRequest
from drills.domain.workload import (
    Arrival,
    ChatWorkload,
    Conversations,
    TeamSpec,
)
from engine_nodes.domain.perf import PROFILES, PerfProfile
from models_registry.domain.capacity import CapacityRecord, pool_capacity_tokens
from routing.domain import limiter
from routing.domain.admission import AdmissionQueue, Candidate, Outcome, PoolState
from routing.domain.policies import RouteRequest, make_policy
from routing.domain.retry_budget import RetryBudget
from routing.domain.snapshot import NodeSnapshot
from routing.domain.tiers import Tier

__all__ = [
    "FleetConfig",
    "FleetEvent",
    "FleetResult",
    "FleetSim",
    "percentile",
]

_MODEL, _VERSION = "chat-7b", "v1"
# Event kinds, in the order simultaneous events run (then by sequence).
_WAKE, _READY, _SCENARIO, _ARRIVAL, _PUMP, _SAMPLE = range(6)
_PUMP_S = 0.05  # the admission queue's tick while anything waits (as the gateway)
# "unfinished": still running when the drain after the window ran out.
OUTCOMES = (
    "ok",
    "error",
    "rate_limited",
    "shed",
    "no_replica",
    "too_large",
    "unfinished",
)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The fleet and the platform settings the simulation runs with.

    ``min_bound_tokens`` and ``replica_tokens_in_flight`` default to the platform's
    settings (``PLATFORM_AFFINITY_MIN_BOUND_TOKENS``,
    ``PLATFORM_DEFAULT_REPLICA_TOKENS_IN_FLIGHT``); ``block_size`` is the simulated
    KV block (the same memory in fewer, larger blocks is faster to simulate; hits
    are then whole blocks of this size).
    """

    replicas: int = 12
    profile: str = "a100-8b"
    policy: str = "prefix_affinity"
    block_size: int = 64
    load_factor: float = 1.25
    min_bound_tokens: int = 16_384
    admission: bool = False
    replica_tokens_in_flight: int = 110_000
    max_queue: int = 256
    max_wait_s: float = 10.0
    batch_ceiling: float = 1.0
    retry_ratio: float = 0.1
    retry_min: int = 3
    cold_start_s: float = 0.0
    sample_s: float = 1.0
    jitter_cv: float = 0.04
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("a fleet needs at least one replica")
        if self.profile not in PROFILES:
            raise ValueError(
                f"unknown profile {self.profile!r}; known: {', '.join(PROFILES)}"
            )
        if self.block_size < 1 or self.sample_s <= 0:
            raise ValueError("block_size and sample_s must be positive")

    @property
    def perf_profile(self) -> PerfProfile:
        return PROFILES[self.profile]


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """Something that happens to the fleet at ``at`` seconds.

    Kinds: ``lose_replica`` (``replica`` or else the ``count`` most loaded die),
    ``add_replica`` (``count`` new replicas, serving after ``cold_start_s``),
    ``rate`` (all arrivals run at ``factor`` times the base rate from now on),
    ``team_rate`` (``team``'s arrivals run at ``factor`` times its base rate).
    """

    at: float
    kind: str
    count: int = 1
    factor: float = 1.0
    replica: str | None = None
    team: str | None = None

    def __post_init__(self) -> None:
        kinds = ("lose_replica", "add_replica", "rate", "team_rate")
        if self.kind not in kinds:
            raise ValueError(f"event kind must be one of {', '.join(kinds)}")
        if self.at < 0 or self.count < 1 or self.factor < 0:
            raise ValueError("events need at >= 0, count >= 1 and factor >= 0")
        if self.kind == "team_rate" and not self.team:
            raise ValueError("a team_rate event names its team")


@dataclass(slots=True)
class Sample:
    """The fleet at one sampling instant."""

    at: float
    replicas: int
    tokens_in_flight: list[int]
    queued: dict[str, int]
    engine_waiting: int

    @property
    def imbalance(self) -> float | None:
        """Highest tokens in flight over the pool average (None when idle)."""
        if not self.tokens_in_flight:
            return None
        mean = sum(self.tokens_in_flight) / len(self.tokens_in_flight)
        return max(self.tokens_in_flight) / mean if mean > 0 else None


@dataclass(slots=True)
class FleetResult:
    """Requests that arrived inside the measured window, and the samples."""

    config: FleetConfig
    started_at: float
    ended_at: float
    block_size: int
    requests: list[FleetRequest] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    generated_tokens: int = 0
    prefill_tokens: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return self.ended_at - self.started_at

    def summary(self) -> dict[str, object]:
        """Return the headline figures of the run (see the module docstring)."""
        ok = [r for r in self.requests if r.outcome == "ok"]
        cacheable = sum(r.cacheable_tokens(self.block_size) for r in ok)
        cached = sum(
            min(r.cached_tokens, r.cacheable_tokens(self.block_size)) for r in ok
        )
        prompt = sum(r.prompt_tokens for r in ok)
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
        imbalances = [s.imbalance for s in self.samples if s.imbalance is not None]
        duration = max(self.duration_s, 1e-9)
        outcomes = {name: 0 for name in OUTCOMES}
        for request in self.requests:
            outcomes[request.outcome] = outcomes.get(request.outcome, 0) + 1
        return {
            "duration_s": self.duration_s,
            "requests": len(self.requests),
            "outcomes": outcomes,
            "prefix_hit_rate": cached / cacheable if cacheable else None,
            "cached_token_share": sum(r.cached_tokens for r in ok) / prompt
            if prompt
            else None,
            "ttft_p50_s": percentile(ttfts, 0.50),
            "ttft_p95_s": percentile(ttfts, 0.95),
            "ttft_p99_s": percentile(ttfts, 0.99),
            "tpot_p50_s": percentile(tpots, 0.50),
            "tpot_p95_s": percentile(tpots, 0.95),
            "output_tokens_per_s": self.generated_tokens / duration,
            "prefill_tokens_per_s": sum(r.prompt_tokens for r in ok) / duration,
            "uncached_prefill_tokens_per_s": sum(
                r.prompt_tokens - r.cached_tokens for r in ok
            )
            / duration,
            "imbalance_mean": sum(imbalances) / len(imbalances) if imbalances else None,
            "imbalance_peak": max(imbalances) if imbalances else None,
        }

    def by(self, attribute: str) -> dict[str, dict[str, object]]:
        """Return per-team or per-tier figures: requests, outcomes, TTFT p50/p95."""
        groups: dict[str, list[FleetRequest]] = {}
        for request in self.requests:
            groups.setdefault(getattr(request, attribute), []).append(request)
        table: dict[str, dict[str, object]] = {}
        for name, requests in sorted(groups.items()):
            ttfts = [r.ttft_s for r in requests if r.outcome == "ok" and r.ttft_s]
            counts = {outcome: 0 for outcome in OUTCOMES}
            for request in requests:
                counts[request.outcome] += 1
            table[name] = {
                "requests": len(requests),
                **counts,
                "ttft_p50_s": percentile(ttfts, 0.50),
                "ttft_p95_s": percentile(ttfts, 0.95),
            }
        return table


class FleetSim:
    """One pool of replicas behind one gateway, fed by a workload or a trace."""

    def __init__(
        self,
        config: FleetConfig,
        workload: ChatWorkload | None = None,
        *,
        arrivals: Iterable[Arrival] | None = None,
        events: Iterable[FleetEvent] = (),
        teams: Iterable[TeamSpec] = (),
    ) -> None:
        if (workload is None) == (arrivals is None):
            raise ValueError("give a workload or a stream of arrivals, not both")
        self.config = config
        self.workload = workload
        profile = config.perf_profile
        self.profile = profile
        self._rng = random.Random(config.seed)
        # One stream per team: changing one team's rate leaves every other team's
        # requests exactly as they were, so scenarios compare request for request.
        self._team_rngs: dict[str, random.Random] = {}
        self.policy = make_policy(config.policy)
        if hasattr(self.policy, "min_bound_tokens"):
            self.policy.min_bound_tokens = config.min_bound_tokens  # type: ignore[attr-defined]
        if hasattr(self.policy, "load_factor"):
            self.policy.load_factor = config.load_factor  # type: ignore[attr-defined]
        self.budget = RetryBudget(
            ratio=config.retry_ratio, min_retries=config.retry_min
        )
        self.queue = AdmissionQueue(
            max_queue=config.max_queue,
            max_wait_s=config.max_wait_s,
            batch_ceiling=config.batch_ceiling,
        )
        team_list = list(workload.teams if workload is not None else ()) + list(teams)
        self.teams: dict[str, TeamSpec] = {team.name: team for team in team_list}
        self.replicas: dict[str, FleetReplica] = {}
        self.serving: list[FleetReplica] = []
        self._replica_count = 0
        for _ in range(config.replicas):
            self._serve(self._new_replica())
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._wake_version: dict[str, int] = {}
        self._events = sorted(events, key=lambda e: e.at)
        self._buckets: dict[str, limiter.Bucket] = {}
        self._queued: dict[str, FleetRequest] = {}
        self._pool_in_flight = 0
        self._team_in_flight: dict[str, int] = {}
        self._team_slots: dict[str, int] = {}  # concurrency slots held per team
        self._pump_scheduled = False
        self._next_request_id = 0
        self._rate_factor = 1.0
        self._team_factor: dict[str, float] = {}
        self._arrival_version: dict[str, int] = {}
        self._conversations = (
            Conversations(workload, self._rng) if workload is not None else None
        )
        self._team_users = workload.team_users() if workload is not None else {}
        self._trace: Iterator[Arrival] | None = (
            iter(arrivals) if arrivals is not None else None
        )
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
            block_size=self.config.block_size,
        )
        for event in self._events:
            self._push(event.at, _SCENARIO, event)
        if self.workload is not None:
            for team in self.workload.teams:
                self._schedule_arrival(team.name, 0.0)
        else:
            self._next_trace_arrival()
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
            if kind == _WAKE:
                self._on_wake(payload)  # type: ignore[arg-type]
            elif kind == _ARRIVAL:
                self._on_arrival(payload)  # type: ignore[arg-type]
            elif kind == _PUMP:
                self._pump_scheduled = False
                self._pump()
            elif kind == _SAMPLE:
                self._sample()
                self._push(at + self.config.sample_s, _SAMPLE, None)
            elif kind == _SCENARIO:
                self._on_event(payload)  # type: ignore[arg-type]
            elif kind == _READY:
                self._serve(payload)  # type: ignore[arg-type]
                result.events.append((at, f"replica {payload.replica_id} serving"))  # type: ignore[attr-defined]
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
        )
        self.replicas[replica.replica_id] = replica
        return replica

    def _serve(self, replica: FleetReplica) -> None:
        self.serving.append(replica)
        self.serving.sort(key=lambda r: r.replica_id)

    def _generated(self) -> int:
        return sum(r.generated_tokens for r in self.replicas.values())

    def _prefilled(self) -> int:
        return sum(r.prefill_tokens for r in self.replicas.values())

    def _kick(self, replica: FleetReplica) -> None:
        """Make ``replica`` notice new work: plan if idle, else cut its segment."""
        if replica.segment is None:
            end = replica.plan(self.now)
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
        _first, finished = replica.complete(self.now)
        for request in finished:
            request.outcome = "ok"
            self._give_back(request, used=request.prompt_tokens + request.output_tokens)
        end = replica.plan(self.now)
        if end is not None:
            self._wake_version[replica.replica_id] = version + 1
            self._push(end, _WAKE, (replica, version + 1))
        if finished and self._queued:
            self._pump()

    # -- arrivals ----------------------------------------------------------------------

    def _schedule_arrival(self, team: str, after: float) -> None:
        workload = self.workload
        assert workload is not None
        spec = self.teams[team]
        rate = (
            workload.team_rate(spec)
            * self._rate_factor
            * self._team_factor.get(team, 1.0)
        )
        version = self._arrival_version.get(team, 0) + 1
        self._arrival_version[team] = version
        if rate <= 0:
            return
        at = after + self._team_rng(team).expovariate(rate)
        self._push(at, _ARRIVAL, (team, version))

    def _team_rng(self, team: str) -> random.Random:
        rng = self._team_rngs.get(team)
        if rng is None:
            rng = self._team_rngs[team] = random.Random(f"{self.config.seed}:{team}")
        return rng

    def _next_trace_arrival(self) -> None:
        assert self._trace is not None
        arrival = next(self._trace, None)
        if arrival is not None:
            self._push(arrival.at, _ARRIVAL, arrival)

    def _on_arrival(self, payload: object) -> None:
        if isinstance(payload, Arrival):
            arrival = payload
            self._next_trace_arrival()
            if arrival.team not in self.teams:
                self.teams[arrival.team] = TeamSpec(arrival.team, tier=arrival.tier)
        else:
            team, version = payload  # type: ignore[misc]
            if self._arrival_version.get(team) != version:
                return  # the team's rate changed; a fresh arrival was drawn
            self._schedule_arrival(team, self.now)
            users = self._team_users[team]
            user = users.start + self._team_rng(team).randrange(len(users))
            assert self._conversations is not None
            arrival = self._conversations.next_request(user, self.teams[team], self.now)
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
        )
        if self._window[0] <= self.now < self._window[1]:
            assert self._result is not None
            self._result.requests.append(request)
        self._admit(request)

    # -- the gateway's decisions ----------------------------------------------------------

    def _admit(self, request: FleetRequest) -> None:
        team = self.teams[request.team]
        amount = request.prompt_tokens + request.max_tokens
        now = self.now
        if team.tokens_per_minute:
            capacity = team.tokens_per_minute
            try:
                charge = limiter.charge(
                    self._buckets.get(team.name),
                    now,
                    capacity=capacity,
                    refill_per_s=capacity / 60.0,
                    amount=amount,
                )
            except limiter.ChargeTooLarge:
                self._end(request, "too_large")
                return
            if not charge.allowed:
                self._buckets[team.name] = charge.bucket
                self._end(request, "rate_limited")
                return
            if not self._take_slot(team, request):
                # As the gateway: no slot, nothing charged.
                self._end(request, "rate_limited")
                return
            self._buckets[team.name] = charge.bucket
            request.charged = amount
        elif not self._take_slot(team, request):
            self._end(request, "rate_limited")
            return
        if not self.config.admission:
            self._route(request, first=True)
            return
        capacity = self._pool_capacity()
        if capacity <= 0:
            self._refund(request, used=0)
            self._end(request, "no_replica")
            return
        candidate = Candidate(
            request_id=str(request.request_id),
            team=team.name,
            tier=Tier(request.tier),
            tokens=amount,
            guaranteed_share=team.guaranteed_share,
            arrived_at=now,
        )
        try:
            verdict, shed = self.queue.offer(candidate, self._pool_state(capacity), now)
        except limiter.ChargeTooLarge:
            self._refund(request, used=0)
            self._end(request, "too_large")
            return
        self._shed(shed)
        if verdict.outcome == Outcome.ADMIT:
            self._take(request)
            self._route(request, first=True)
        elif verdict.outcome == Outcome.QUEUE:
            self._queued[candidate.request_id] = request
            self._schedule_pump()
        else:
            self._refund(request, used=0)
            outcome = (
                "rate_limited" if verdict.outcome == Outcome.RATE_LIMITED else "shed"
            )
            self._end(request, outcome)

    def _take_slot(self, team: TeamSpec, request: FleetRequest) -> bool:
        """Take one of the team's concurrency slots; False when all are held."""
        if not team.max_concurrency:
            return True
        held = self._team_slots.get(team.name, 0)
        if held >= team.max_concurrency:
            return False
        self._team_slots[team.name] = held + 1
        request.holds_slot = True
        return True

    def _release_slot(self, request: FleetRequest) -> None:
        if request.holds_slot:
            request.holds_slot = False
            self._team_slots[request.team] -= 1

    def _pool_capacity(self) -> int:
        return pool_capacity_tokens(
            len(self.serving),
            CapacityRecord(tokens_per_s=None, tokens_in_flight=None),
            self.config.replica_tokens_in_flight,
        )

    def _pool_state(self, capacity: int) -> PoolState:
        return PoolState(
            capacity=capacity,
            in_flight=self._pool_in_flight,
            team_in_flight=self._team_in_flight,
        )

    def _take(self, request: FleetRequest) -> None:
        amount = request.prompt_tokens + request.max_tokens
        request.taken = True
        self._pool_in_flight += amount
        self._team_in_flight[request.team] = (
            self._team_in_flight.get(request.team, 0) + amount
        )

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self._push(self.now + _PUMP_S, _PUMP, None)

    def _pump(self) -> None:
        if not self._queued:
            return
        capacity = self._pool_capacity()
        if capacity > 0:
            pumped = self.queue.pump(self._pool_state(capacity), self.now)
            self._shed(pumped.shed)
            for request_id in pumped.admitted:
                request = self._queued.pop(request_id)
                self._take(request)
                self._route(request, first=True)
        if self._queued:
            self._schedule_pump()

    def _shed(self, shed: Iterable[tuple[str, int]]) -> None:
        for request_id, _retry_after in shed:
            request = self._queued.pop(request_id, None)
            if request is not None:
                self._refund(request, used=0)
                self._end(request, "shed")

    def _route(self, request: FleetRequest, *, first: bool) -> None:
        now = self.now
        if first:
            self.budget.record_request(now)
        nodes = [
            NodeSnapshot(
                replica_id=replica.replica_id,
                url="",
                tokens_in_flight=replica.tokens_in_flight(now),
                queue_depth=replica.num_waiting,
                kv_cache_usage_perc=replica.kv_cache_usage_perc,
            )
            for replica in self.serving
        ]
        decision = self.policy.choose(
            RouteRequest(
                model=_MODEL,
                version=_VERSION,
                routing_key=f"conv-{request.conversation}",
                team=request.team,
                request_tokens=request.prompt_tokens + request.max_tokens,
            ),
            nodes,
            now,
        )
        if not decision.candidates:
            self._give_back(request, used=0)
            self._end(request, "no_replica")
            return
        replica = self.replicas[decision.candidates[0]]
        request.routed_at = now
        request.attempts += 1
        replica.add(request)
        self._kick(replica)

    def _give_back(self, request: FleetRequest, *, used: int) -> None:
        """The answer ended: refund the bucket, free the slot and the pool's tokens."""
        self._refund(request, used=used)
        self._release_slot(request)
        if request.taken:
            request.taken = False
            amount = request.prompt_tokens + request.max_tokens
            self._pool_in_flight -= amount
            self._team_in_flight[request.team] -= amount
        if request.finished_at is None:
            request.finished_at = self.now

    def _refund(self, request: FleetRequest, *, used: int) -> None:
        if not request.charged:
            return
        team = self.teams[request.team]
        capacity = team.tokens_per_minute
        unused = max(0, request.charged - used)
        request.charged = 0
        if unused:
            self._buckets[team.name] = limiter.refund(
                self._buckets.get(team.name),
                self.now,
                capacity=capacity,
                refill_per_s=capacity / 60.0,
                amount=unused,
            )

    def _end(self, request: FleetRequest, outcome: str) -> None:
        self._release_slot(request)
        request.outcome = outcome
        request.finished_at = self.now

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
            self._rate_factor = event.factor
            for team in self.teams:
                if team in self._team_users:
                    self._schedule_arrival(team, self.now)
            self._result.events.append((self.now, f"arrivals x{event.factor:g}"))
        elif event.kind == "team_rate":
            assert event.team is not None
            if event.team not in self._team_users:
                raise ValueError(f"no team {event.team!r} in the workload")
            self._team_factor[event.team] = event.factor
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
        for request in replica.fail(self.now):
            if request.first_token_at is None and self.budget.try_spend(self.now):
                self._route(request, first=False)
                continue
            request.output_tokens = request.tokens_at_failure
            self._give_back(
                request, used=request.prompt_tokens + request.tokens_at_failure
            )
            self._end(request, "error")

    # -- sampling ------------------------------------------------------------------------

    def _sample(self) -> None:
        assert self._result is not None
        if not self._window[0] <= self.now <= self._window[1]:
            return
        queued: dict[str, int] = {tier.value: 0 for tier in Tier}
        for request in self._queued.values():
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
