"""The embedding drill: a RAG ingestion burst on an embedding pool beside the chat
pools, sized by the platform's autoscaler in virtual time.

Public surface: ``EmbeddingPerf``, ``EmbeddingScenario``, ``EmbeddingBin``,
``EmbeddingReport``, ``embedding_settings``, ``run_embedding_drill``,
``at_profile``, ``capacity_plan_keys``.

The policy is ``models_registry.domain.autoscaler.decide``, the live tick's own,
called every ``interval_s`` with the pool as the live tick observes it: an
embedding pool (``PoolKind.EMBEDDING``) whose one gateway's cumulative count of
admitted tokens (``admitted_tokens``, what ``routing.admission`` counts into its
share) gives the input tokens/s, against ``replica_tokens_per_s`` a replica (the
load-test gate's figure). The chat pools are the GPUs they hold
(``chat_gpus`` of the region's ``region_gpus``): the embedding pool may start
replicas only on what is left (``capacity_exhausted`` beyond). Their requests are
not simulated: this drill is about the embedding pool.

The load: search queries all along (``query_rps`` requests of one short text), and
from ``burst_at_s`` for ``burst_s`` an ingestion of ``ingest_rps`` requests of
``texts`` chunks of ``chunk_tokens`` each. Arrivals are Poisson (seeded). Each
request is admitted while the pool's tokens in flight stay within its serving
replicas' ``replica_tokens_in_flight`` each (the load test's other figure, as
admission divides by it), else it waits in the gateway's admission queue (FIFO,
never shed here: an ingestion waits); admitted, it goes to the serving replica
with the fewest input tokens queued or running (least tokens in flight). The
policy sees the admitted count and the admission queue, as live. A replica is a
batcher (``EmbeddingPerf``, the simulated replica's shape): waiting requests go in
together up to ``max_batch_tokens``, and a batch takes ``batch_base_ms`` plus
``per_token_ms`` per token. The defaults are the drill's own figures (about
120,000 tokens/s a replica, a load test's 80,000); ``at_profile`` puts the
simulated replica's profile in their place (``a100-minilm``, the A100 estimate of
``simengine.domain.embedding_perf``: about 4.6 M tokens/s, and a load test's
figure of the same), as ``manage.py embedding_drill --embedding-profile`` does,
and ``capacity_plan_keys`` states the scenario as the capacity plan's
``embedding`` section, so the two size the pool alike; the engine's own queue is not
passed to the policy, as in the fleet simulator (``drills.domain.fleet_scaling``).

A start takes ``cold_start`` (the seed's sum with the embedding model's small
weights); a scale-down cancels the newest start first, else drains the serving
replica with the fewest tokens, which stops once its batches are done. Every
replica is billed from its start to its stop.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import cast

from drills.domain.fleet_scaling import ColdStart
from drills.domain.overload import Check
from models_registry.domain.autoscaler import (
    AutoscalerState,
    PoolKind,
    PoolSignals,
    ScalingDecision,
    ScalingSettings,
    decide,
)
from simengine.domain.embedding_perf import EmbeddingProfile

__all__ = [
    "EmbeddingBin",
    "EmbeddingPerf",
    "EmbeddingReport",
    "EmbeddingScenario",
    "at_profile",
    "capacity_plan_keys",
    "embedding_settings",
    "run_embedding_drill",
]

_GATEWAY = "gateway-1"


@dataclass(frozen=True, slots=True)
class EmbeddingPerf:
    """One replica's batch time: ``batch_base_ms`` + ``per_token_ms`` x tokens, at
    most ``max_batch_tokens`` a batch (about 120,000 tokens/s when full)."""

    batch_base_ms: float = 5.0
    per_token_ms: float = 0.008
    max_batch_tokens: int = 16_384

    def batch_s(self, tokens: int) -> float:
        return (self.batch_base_ms + self.per_token_ms * tokens) / 1000.0

    @classmethod
    def from_profile(cls, profile: EmbeddingProfile) -> EmbeddingPerf:
        """Return the simulated replica's batch time on ``profile``'s device."""
        return cls(
            batch_base_ms=profile.batch_base_ms,
            per_token_ms=profile.per_token_ms,
            max_batch_tokens=profile.max_batch_tokens,
        )


def embedding_settings() -> ScalingSettings:
    """The embedding pool's autoscaling settings (the operator's choice): the
    seed's thresholds and windows, 1 to 16 replicas, and a scale-down a minute (an
    ingestion pool's load ends at once, and a replica starts in minutes)."""
    return ScalingSettings(
        min_replicas=1,
        max_replicas=16,
        target_utilisation=0.7,
        scale_down_utilisation=0.5,
        stable_window_s=60.0,
        panic_window_s=6.0,
        panic_factor=2.0,
        scale_down_interval_s=60.0,
    )


@dataclass(frozen=True, slots=True)
class EmbeddingScenario:
    """The drill's load, pool and region (defaults: the seed's scale)."""

    seed: int = 0
    duration_s: float = 2_400.0
    burst_at_s: float = 300.0
    burst_s: float = 900.0
    query_rps: float = 50.0
    query_tokens: int = 32
    ingest_rps: float = 60.0
    texts: int = 32
    chunk_tokens: int = 256
    replica_tokens_per_s: float = 80_000.0  # the load test's, at its latency target
    replica_tokens_in_flight: int = 16_384  # and the tokens in flight there
    perf: EmbeddingPerf = field(default_factory=EmbeddingPerf)
    settings: ScalingSettings = field(default_factory=embedding_settings)
    interval_s: float = 5.0
    cold_start: ColdStart = field(default_factory=lambda: ColdStart(weights_gb=1.3))
    region_gpus: int = 64
    chat_gpus: int = 48  # the chat pools' replicas beside it
    gpus_per_replica: int = 1
    bin_s: float = 30.0
    latency_target_s: float = 1.0

    def __post_init__(self) -> None:
        if min(self.duration_s, self.burst_s, self.interval_s, self.bin_s) <= 0:
            raise ValueError("durations, the interval and the bin must be positive")
        if self.replica_tokens_per_s <= 0 or self.chat_gpus > self.region_gpus:
            raise ValueError("a replica carries tokens; chat holds at most the region")

    @property
    def burst_tokens_per_s(self) -> float:
        """The ingestion's input tokens/s, on top of the queries'."""
        return self.ingest_rps * self.texts * self.chunk_tokens

    @property
    def query_tokens_per_s(self) -> float:
        return self.query_rps * self.query_tokens

    @property
    def needed_at_burst(self) -> int:
        """Replicas the policy should settle on during the burst."""
        demand = self.burst_tokens_per_s + self.query_tokens_per_s
        per = self.settings.target_utilisation * self.replica_tokens_per_s
        return math.ceil(demand / per)


def at_profile(s: EmbeddingScenario, profile: EmbeddingProfile) -> EmbeddingScenario:
    """Return ``s`` with replicas of ``profile``: its batch time, and as the load
    test's figures its input tokens/s in full batches and the tokens in flight that
    rate keeps for ``latency_target_s`` (Little's law)."""
    tokens_per_s = profile.full_batch_tokens_per_s
    return replace(
        s,
        perf=EmbeddingPerf.from_profile(profile),
        replica_tokens_per_s=tokens_per_s,
        replica_tokens_in_flight=max(
            profile.max_batch_tokens, round(tokens_per_s * s.latency_target_s)
        ),
    )


def capacity_plan_keys(s: EmbeddingScenario) -> dict[str, float]:
    """Return the capacity plan's ``embedding`` keys for the drill's burst (dotted,
    for ``Scenario.from_mapping``): one region carrying it all, as the plan's
    region does when the other is lost."""
    return {
        "embedding.ingest_requests_per_s": s.ingest_rps,
        "embedding.texts_per_request": s.texts,
        "embedding.tokens_per_text": s.chunk_tokens,
        "embedding.search_queries_per_s": s.query_rps,
        "embedding.query_tokens": s.query_tokens,
        "embedding.replica_input_tokens_per_s": s.replica_tokens_per_s,
        "embedding.gpus_per_replica": s.gpus_per_replica,
        "embedding.target_utilisation": s.settings.target_utilisation,
    }


@dataclass(frozen=True, slots=True)
class EmbeddingBin:
    """One ``bin_s`` of the run: offered and served input tokens/s, replicas
    (serving at its end, the policy's desired size), and the p95 latency of the
    requests that ended in it (None: none ended)."""

    start_s: float
    offered_tokens_per_s: float
    served_tokens_per_s: float
    serving: int
    desired: int
    measured_tokens_per_s: float | None
    p95_latency_s: float | None

    def as_dict(self) -> dict[str, object]:
        return {
            "start_s": self.start_s,
            "offered_tokens_per_s": self.offered_tokens_per_s,
            "served_tokens_per_s": self.served_tokens_per_s,
            "serving": self.serving,
            "desired": self.desired,
            "measured_tokens_per_s": self.measured_tokens_per_s,
            "p95_latency_s": self.p95_latency_s,
        }


@dataclass(frozen=True, slots=True)
class EmbeddingReport:
    """The run's bins, the policy's decisions, the bill and the checks."""

    scenario: EmbeddingScenario
    bins: tuple[EmbeddingBin, ...]
    decisions: tuple[ScalingDecision, ...]  # the ticks that changed the size
    gpu_hours: float
    fixed_gpu_hours: float  # a pool held at the burst's size all along
    peak_desired: int
    first_scale_up_s: float | None  # after the burst began
    capacity_at_s: float | None  # the burst's size serving, after it began
    back_to_floor_s: float | None  # after the burst ended
    latency_recovered_s: float | None  # p95 under target from then to its end
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def as_dict(self) -> dict[str, object]:
        s = self.scenario
        return {
            "scenario": {
                "seed": s.seed,
                "duration_s": s.duration_s,
                "burst_at_s": s.burst_at_s,
                "burst_s": s.burst_s,
                "query_tokens_per_s": s.query_tokens_per_s,
                "burst_tokens_per_s": s.burst_tokens_per_s,
                "texts_per_request": s.texts,
                "chunk_tokens": s.chunk_tokens,
                "replica_tokens_per_s": s.replica_tokens_per_s,
                "region_gpus": s.region_gpus,
                "chat_gpus": s.chat_gpus,
                "cold_start_s": s.cold_start.cold_s,
                "needed_at_burst": s.needed_at_burst,
            },
            "peak_desired": self.peak_desired,
            "first_scale_up_s": self.first_scale_up_s,
            "capacity_at_s": self.capacity_at_s,
            "back_to_floor_s": self.back_to_floor_s,
            "latency_recovered_s": self.latency_recovered_s,
            "gpu_hours": self.gpu_hours,
            "fixed_gpu_hours": self.fixed_gpu_hours,
            "decisions": [
                {
                    "at": d.at,
                    "from": d.current,
                    "to": d.desired,
                    "reason": d.reason.value,
                    "admitted_tokens_per_s": d.signals.get("admitted_tokens_per_s"),
                }
                for d in self.decisions
            ],
            "bins": [b.as_dict() for b in self.bins],
            "checks": [c.as_dict() for c in self.checks],
            "passed": self.passed,
        }


@dataclass(slots=True)
class _Replica:
    replica_id: int
    started_at: float
    ready_at: float
    state: str = "starting"  # starting | serving | draining | stopped
    queue: deque[tuple[float, int]] = field(default_factory=deque)  # (arrived, tokens)
    queued_tokens: int = 0
    running_tokens: int = 0
    is_busy: bool = False
    stopped_at: float | None = None

    @property
    def load(self) -> int:
        return self.queued_tokens + self.running_tokens


class _Run:
    """The event loop: arrivals, batches, starts and the policy's ticks."""

    def __init__(self, scenario: EmbeddingScenario) -> None:
        self.s = scenario
        self.rng = random.Random(scenario.seed)
        self.events: list[tuple[float, int, str, object]] = []
        self.order = itertools.count()
        self.ids = itertools.count()
        self.replicas: list[_Replica] = []
        self.state = AutoscalerState()
        self.admitted = 0
        self.waiting: deque[tuple[float, int]] = deque()  # the admission queue
        self.waiting_tokens = 0
        self.desired = scenario.settings.min_replicas
        self.decisions: list[ScalingDecision] = []
        self.ticks: list[ScalingDecision] = []
        # Per bin: offered tokens, served tokens, latencies; at its end, replicas.
        n_bins = math.ceil(scenario.duration_s / scenario.bin_s)
        self.offered = [0] * n_bins
        self.served = [0] * n_bins
        self.latencies: list[list[float]] = [[] for _ in range(n_bins)]
        self.serving_at = [0] * n_bins
        self.desired_at = [0] * n_bins

    def push(self, at: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self.events, (at, next(self.order), kind, payload))

    def run(self) -> None:
        s = self.s
        for _ in range(s.settings.min_replicas):
            replica = self._new_replica(0.0, ready_at=0.0)
            replica.state = "serving"
        self.push(0.0, "query")
        self.push(s.burst_at_s, "ingest")
        self.push(s.interval_s, "tick")
        for index in range(len(self.serving_at)):
            self.push((index + 1) * s.bin_s - 1e-9, "bin", index)
        while self.events:
            at, _, kind, payload = heapq.heappop(self.events)
            if at > s.duration_s:
                break
            getattr(self, f"_on_{kind}")(at, payload)
        for replica in self.replicas:
            if replica.stopped_at is None:
                replica.stopped_at = s.duration_s

    # -- load ----------------------------------------------------------------------

    def _on_query(self, at: float, _: object) -> None:
        self._arrive(at, self.s.query_tokens)
        self.push(at + self.rng.expovariate(self.s.query_rps), "query")

    def _on_ingest(self, at: float, _: object) -> None:
        s = self.s
        if at >= s.burst_at_s + s.burst_s:
            return
        self._arrive(at, s.texts * s.chunk_tokens)
        self.push(at + self.rng.expovariate(s.ingest_rps), "ingest")

    def _arrive(self, at: float, tokens: int) -> None:
        self.offered[self._bin(at)] += tokens
        self.waiting.append((at, tokens))
        self.waiting_tokens += tokens
        self._pump(at)

    def _pump(self, at: float) -> None:
        """Admit what fits in the pool's tokens in flight, oldest first."""
        serving = [r for r in self.replicas if r.state == "serving"]
        if not serving:
            return
        capacity = len(serving) * self.s.replica_tokens_in_flight
        in_flight = sum(r.load for r in self.replicas if r.state != "stopped")
        while self.waiting and (
            in_flight == 0 or in_flight + self.waiting[0][1] <= capacity
        ):
            arrived, tokens = self.waiting.popleft()
            self.waiting_tokens -= tokens
            in_flight += tokens
            self.admitted += tokens  # the gateway's count (routing.admission)
            replica = min(serving, key=lambda r: (r.load, r.replica_id))
            replica.queue.append((arrived, tokens))
            replica.queued_tokens += tokens
            if not replica.is_busy:
                self._start_batch(replica, at)

    # -- replicas --------------------------------------------------------------------

    def _start_batch(self, replica: _Replica, at: float) -> None:
        batch: list[tuple[float, int]] = []
        tokens = 0
        limit = self.s.perf.max_batch_tokens
        while replica.queue and (not batch or tokens + replica.queue[0][1] <= limit):
            arrived, n = replica.queue.popleft()
            batch.append((arrived, n))
            tokens += n
        replica.queued_tokens -= tokens
        replica.running_tokens = tokens
        replica.is_busy = True
        self.push(at + self.s.perf.batch_s(tokens), "batch", (replica, batch))

    def _on_batch(self, at: float, payload: object) -> None:
        replica, batch = cast("tuple[_Replica, list[tuple[float, int]]]", payload)
        index = self._bin(at)
        for arrived, tokens in batch:
            self.served[index] += tokens
            self.latencies[index].append(at - arrived)
        replica.running_tokens = 0
        replica.is_busy = False
        if replica.queue:
            self._start_batch(replica, at)
        elif replica.state == "draining":
            replica.state, replica.stopped_at = "stopped", at
        self._pump(at)

    def _on_ready(self, at: float, replica: _Replica) -> None:
        if replica.state == "starting":
            replica.state = "serving"
            self._pump(at)

    def _new_replica(self, at: float, *, ready_at: float) -> _Replica:
        replica = _Replica(next(self.ids), started_at=at, ready_at=ready_at)
        self.replicas.append(replica)
        return replica

    # -- the policy --------------------------------------------------------------------

    def _on_tick(self, at: float, _: object) -> None:
        s = self.s
        serving = [r for r in self.replicas if r.state == "serving"]
        starting = [r for r in self.replicas if r.state == "starting"]
        alive = [r for r in self.replicas if r.state != "stopped"]
        free = s.region_gpus - s.chat_gpus - len(alive) * s.gpus_per_replica
        signals = PoolSignals(
            at=at,
            serving=len(serving),
            starting=len(starting),
            tokens_in_flight=sum(r.load for r in alive),
            queued_tokens=self.waiting_tokens,
            queue_depth=len(self.waiting),
            replica_tokens_in_flight=s.replica_tokens_in_flight,
            gpus_per_replica=s.gpus_per_replica,
            free_gpus=max(0, free),
            kind=PoolKind.EMBEDDING,
            admitted_tokens={_GATEWAY: self.admitted},
            replica_tokens_per_s=s.replica_tokens_per_s,
        )
        decision, self.state = decide(s.settings, self.state, signals)
        self.ticks.append(decision)
        self.desired = decision.desired
        if decision.changed:
            self.decisions.append(decision)
            self._converge(at, decision.desired - decision.current)
        self.push(at + s.interval_s, "tick")

    def _converge(self, at: float, change: int) -> None:
        cold = self.s.cold_start.cold_s
        for _ in range(max(0, change)):
            replica = self._new_replica(at, ready_at=at + cold)
            self.push(replica.ready_at, "ready", replica)
        for _ in range(max(0, -change)):
            starting = [r for r in self.replicas if r.state == "starting"]
            if starting:
                newest = max(starting, key=lambda r: r.started_at)
                newest.state, newest.stopped_at = "stopped", at
                continue
            serving = [r for r in self.replicas if r.state == "serving"]
            if len(serving) <= 1:
                return
            leaving = min(serving, key=lambda r: (r.load, -r.replica_id))
            leaving.state = "draining"
            if not leaving.is_busy and not leaving.queue:
                leaving.state, leaving.stopped_at = "stopped", at

    # -- figures -----------------------------------------------------------------------

    def _on_bin(self, at: float, index: object) -> None:
        assert isinstance(index, int)
        self.serving_at[index] = sum(r.state == "serving" for r in self.replicas)
        self.desired_at[index] = self.desired

    def _bin(self, at: float) -> int:
        return min(len(self.offered) - 1, int(at // self.s.bin_s))


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def run_embedding_drill(scenario: EmbeddingScenario) -> EmbeddingReport:
    """Run the burst through the autoscaled embedding pool and judge it."""
    run = _Run(scenario)
    run.run()
    s = scenario
    bins = []
    for index in range(len(run.offered)):
        start = index * s.bin_s
        rates = [
            t.signals["admitted_tokens_per_s"]
            for t in run.ticks
            if start <= t.at < start + s.bin_s
        ]
        bins.append(
            EmbeddingBin(
                start_s=start,
                offered_tokens_per_s=run.offered[index] / s.bin_s,
                served_tokens_per_s=run.served[index] / s.bin_s,
                serving=run.serving_at[index],
                desired=run.desired_at[index],
                measured_tokens_per_s=statistics.fmean(rates) if rates else None,
                p95_latency_s=_p95(run.latencies[index]),
            )
        )
    end = s.burst_at_s + s.burst_s
    gpu_s = sum((r.stopped_at or s.duration_s) - r.started_at for r in run.replicas)
    ups = [d for d in run.decisions if d.desired > d.current and d.at >= s.burst_at_s]
    needed = s.needed_at_burst
    capacity_at = next(
        (
            b.start_s + s.bin_s - s.burst_at_s
            for b in bins
            if b.start_s >= s.burst_at_s and b.serving >= needed
        ),
        None,
    )
    floor = s.settings.min_replicas
    back = next(
        (t.at - end for t in run.ticks if t.at >= end and t.desired == floor), None
    )
    burst_bins = [b for b in bins if s.burst_at_s <= b.start_s < end]
    recovered = None
    for b in reversed(burst_bins):
        if b.p95_latency_s is None or b.p95_latency_s > s.latency_target_s:
            break
        recovered = b.start_s - s.burst_at_s
    report = EmbeddingReport(
        scenario=s,
        bins=tuple(bins),
        decisions=tuple(run.decisions),
        gpu_hours=gpu_s * s.gpus_per_replica / 3600.0,
        fixed_gpu_hours=needed * s.gpus_per_replica * s.duration_s / 3600.0,
        peak_desired=max((t.desired for t in run.ticks), default=floor),
        first_scale_up_s=ups[0].at - s.burst_at_s if ups else None,
        capacity_at_s=capacity_at,
        back_to_floor_s=back,
        latency_recovered_s=recovered,
        checks=(),
    )
    return replace(report, checks=tuple(_checks(report, run.ticks)))


def _checks(report: EmbeddingReport, ticks: list[ScalingDecision]) -> list[Check]:
    s = report.scenario
    needed = s.needed_at_burst
    end = s.burst_at_s + s.burst_s
    # The ticks of the burst's steady part: a stable window after it began, once
    # the pool serves at the size it asked for.
    steady = [
        t.signals["admitted_tokens_per_s"]
        for t in ticks
        if s.burst_at_s + s.settings.stable_window_s <= t.at < end
    ]
    offered = s.burst_tokens_per_s + s.query_tokens_per_s
    measured = statistics.median(steady) if steady else 0.0
    first = report.first_scale_up_s
    # The size the burst settled at (its last tick): under the target, and one
    # fewer would not be under the scale-down threshold (the hysteresis band).
    last = [t for t in ticks if t.at < end]
    size = last[-1].desired if last else 0
    per = s.replica_tokens_per_s
    at_size = offered / (size * per) if size else math.inf
    at_fewer = offered / ((size - 1) * per) if size > 1 else math.inf
    recovered = report.latency_recovered_s
    # A burst the floor carries (a fast replica) needs no scale-up and saves
    # nothing over a pool held at its size: both checks hold at the floor.
    at_floor = needed <= s.settings.min_replicas and report.peak_desired <= needed
    return [
        Check(
            "measures_input_tokens_per_s",
            abs(measured - offered) <= 0.1 * offered,
            f"median of the burst's ticks {measured:,.0f} input tokens/s against "
            f"{offered:,.0f} offered (within 10%)",
        ),
        Check(
            "scales_up_within_two_ticks",
            at_floor
            or (
                first is not None
                and first <= 2 * s.interval_s + s.settings.panic_window_s
            ),
            (
                f"the floor of {s.settings.min_replicas} carries the burst: no "
                "scale-up needed"
                if at_floor
                else f"first scale-up {first if first is None else round(first, 1)} "
                f"s after the burst began (target: "
                f"{2 * s.interval_s + s.settings.panic_window_s:g} s)"
            ),
        ),
        Check(
            "drains_the_cold_start_backlog",
            report.peak_desired >= needed,
            f"peak {report.peak_desired} replicas (the burst alone needs {needed}: "
            f"ceil({offered:,.0f} / (0.7 x {per:,.0f}))); the queue that built up "
            "while they started asks for more, up to the region's free GPUs",
        ),
        Check(
            "settles_between_the_thresholds",
            at_size <= s.settings.target_utilisation
            and at_fewer >= s.settings.scale_down_utilisation,
            f"{size} replicas at the burst's end: {at_size:.0%} utilisation, "
            f"{at_fewer:.0%} with one fewer (band "
            f"{s.settings.scale_down_utilisation:.0%}-"
            f"{s.settings.target_utilisation:.0%})",
        ),
        Check(
            "latency_back_under_target_once_scaled",
            recovered is not None
            and report.capacity_at_s is not None
            and recovered - report.capacity_at_s <= 120.0,
            f"p95 latency per {s.bin_s:g} s under {s.latency_target_s:g} s from "
            + (
                f"{recovered:.0f} s after the burst began to its end"
                if recovered is not None
                else "never"
            )
            + (
                f"; the burst's size served from {report.capacity_at_s:.0f} s "
                f"(a start takes {s.cold_start.cold_s:.0f} s; target: back within "
                "120 s of it)"
                if report.capacity_at_s is not None
                else ""
            ),
        ),
        Check(
            "back_to_the_floor",
            report.back_to_floor_s is not None,
            f"desired back to {s.settings.min_replicas} "
            + (
                f"{report.back_to_floor_s:.0f} s after the burst ended"
                if report.back_to_floor_s is not None
                else "never"
            ),
        ),
        Check(
            "saves_gpu_hours",
            report.gpu_hours < report.fixed_gpu_hours
            or (at_floor and report.gpu_hours <= report.fixed_gpu_hours),
            f"{report.gpu_hours:.2f} GPU-hours against {report.fixed_gpu_hours:.2f} "
            f"for {needed} replicas held all along",
        ),
    ]
