"""Autoscaling in the fleet simulator: the platform's policy in virtual time, with
cold starts, a warm pool, drains and the GPU bill.

Public surface: ``ColdStart``, ``FleetAutoscaling``, ``ReplicaStart``, ``Drain``,
``ScalingTick``, ``ScalingLog``, ``FleetScaler``.

The policy is ``models_registry.domain.autoscaler.decide``, the live task's own, called
every ``interval_s`` (5 s, the live task's beat) with the pool as the simulator
sees it (``FleetScaler.decide``): serving replicas (those in the ring), the starts
in progress, tokens in flight (the admission's count, ``FleetPool.in_flight``:
prompt plus ``max_tokens`` of every admitted request, draining replicas' streams
included), the admission queue's tokens and depth, the per-replica capacity
(``FleetConfig.replica_tokens_in_flight``) and the GPUs the budget has left. The
engine's own waiting requests are not added: their tokens are already in flight
(admitted), and their depth is a transient of step boundaries (a request routed
mid-step waits for the step to end), which would make the queue trigger fire on
noise at every tick.

``FleetSim`` performs the decision; this module keeps what the platform's
machinery would (the agent, the node pool, the bill):

- **Cold start** (``ColdStart``, the seed's sum): node start 240 s, 14 GB of
  weights at 0.5 GB/s (28 s), loaded into GPU memory at 1 GB/s (14 s), warm-up
  30 s: 312 s from the decision to serving.
- **Warm pool**: nodes up with the weights on local disk and no replica, as
  many as the policy's ``ScalingDecision.warm_nodes`` asks at each tick (when
  the pool's settings size it: ``warm_nodes_max`` above 0), else a constant
  ``FleetAutoscaling.warm_nodes``; either way ``FleetAutoscaling.warm_nodes``
  are up at the start. A target that falls releases idle nodes at once (those
  still provisioning first, newest first). A start takes one when there is one and costs only
  load and warm-up (44 s); otherwise it is cold. A node taken from the pool is
  replaced at once by a new node, ready for the pool after node start and the
  weights pull (268 s). A replica stopped after a drain gives its node back to the
  pool when the pool is short (instantly: the weights are on its disk), else the
  node is released. Warm nodes are GPUs that are up: they are billed.
- **Convergence** (``FleetSim``): the live reconcile's own step,
  ``engine_nodes.domain.convergence.converge_steps``, moves the pool to the
  policy's desired size. Starts in progress count (``starting`` until the node is
  up with the weights on its disk, then ``loading``); above target, starts that
  never served are cancelled (``starting`` first, then ``loading``, newest
  first), else one serving replica (the fewest tokens in flight, ties to the
  newest) leaves the ring, and no other drains while it does. Its streams finish,
  then it stops; streams still running at ``drain_deadline_s`` (600 s, the live
  ``PLATFORM_DRAIN_TIMEOUT_S``) end with an error (``Drain.errors``).
- **The bill**: every node is billed from its node start to its release (a
  replica's whole life, starting and draining included, and every warm or
  provisioning node); ``ScalingLog.gpu_hours`` integrates it over a window.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from drills.domain.capacity_plan import Scenario
from engine_nodes.domain.liveness import ReplicaState
from models_registry.domain.autoscaler import (
    AutoscalerState,
    PoolSignals,
    ScalingDecision,
    ScalingSettings,
    decide,
)
from routing.domain.admission import Candidate

__all__ = [
    "ColdStart",
    "Drain",
    "FleetAutoscaling",
    "FleetScaler",
    "ReplicaStart",
    "ScalingLog",
    "ScalingTick",
]

_UNBOUNDED_GPUS = 10**6
# The capacity plan's figures are the seed's: its cold start and the 7B's weights.
_PLAN = Scenario()


@dataclass(frozen=True, slots=True)
class ColdStart:
    """The seed's cold-start sum; its defaults are the capacity plan's
    (``drills.domain.capacity_plan.ColdStart`` and the chat model's weights)."""

    node_start_s: float = float(_PLAN.cold_start.node_start_s)
    weights_gb: float = float(_PLAN.model.weights_gb)
    disk_gb_per_s: float = float(_PLAN.cold_start.disk_gb_per_s)
    load_gb_per_s: float = float(_PLAN.cold_start.load_gb_per_s)
    warmup_s: float = float(_PLAN.cold_start.warmup_s)

    def __post_init__(self) -> None:
        if min(self.node_start_s, self.weights_gb, self.warmup_s) < 0:
            raise ValueError("cold-start times and the weights' size must be >= 0")
        if self.disk_gb_per_s <= 0 or self.load_gb_per_s <= 0:
            raise ValueError("disk and load speeds must be positive")

    @property
    def pull_s(self) -> float:
        """Seconds to pull the weights onto the node's disk."""
        return self.weights_gb / self.disk_gb_per_s

    @property
    def load_s(self) -> float:
        """Seconds to load the weights into GPU memory."""
        return self.weights_gb / self.load_gb_per_s

    @property
    def cold_s(self) -> float:
        """A start on a new node: node start, pull, load, warm-up."""
        return self.node_start_s + self.pull_s + self.load_s + self.warmup_s

    @property
    def warm_s(self) -> float:
        """A start on a warm node (weights on disk): load and warm-up."""
        return self.load_s + self.warmup_s

    @property
    def provision_s(self) -> float:
        """A new node for the warm pool: node start and the weights pull."""
        return self.node_start_s + self.pull_s


@dataclass(frozen=True, slots=True)
class FleetAutoscaling:
    """How the simulated pool autoscales: the pool's settings and the machinery's.

    ``gpu_budget`` is the GPUs the region's nodes can give the pool's replicas
    (free GPUs are the budget less the replicas alive); ``drain_deadline_s`` is how
    long a draining replica's streams may run before they end with an error;
    ``first_tick_s`` is the policy's first call (a drill lets a fleet that starts
    empty, with cold prefix caches, settle first). ``tick_times``, when given, are
    the policy's calls instead (a live window's ticks, replayed at their times:
    the twin check), every ``interval_s`` after the last.
    """

    settings: ScalingSettings
    interval_s: float = 5.0
    cold_start: ColdStart = field(default_factory=ColdStart)
    warm_nodes: int = 0
    gpu_budget: int = _UNBOUNDED_GPUS
    drain_deadline_s: float = 600.0  # the live PLATFORM_DRAIN_TIMEOUT_S's default
    capacity_is_assumed: bool = False
    first_tick_s: float = 0.0
    tick_times: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or min(self.drain_deadline_s, self.first_tick_s) < 0:
            raise ValueError(
                "interval_s must be positive, drain_deadline_s and first_tick_s >= 0"
            )
        times = self.tick_times
        if any(t < 0 for t in times) or any(b <= a for a, b in pairwise(times)):
            raise ValueError("tick_times must be >= 0 and rising")

    def next_tick(self, at: float) -> float:
        """Return the policy's next call after one at ``at``."""
        index = bisect_right(self.tick_times, at)
        if index < len(self.tick_times):
            return self.tick_times[index]
        return at + self.interval_s

    @property
    def start_tick(self) -> float:
        """Return the policy's first call."""
        return self.tick_times[0] if self.tick_times else self.first_tick_s
        if self.warm_nodes < 0 or self.gpu_budget < 0:
            raise ValueError("warm_nodes and gpu_budget must be zero or more")


@dataclass(frozen=True, slots=True)
class ReplicaStart:
    """One replica the autoscaler started: decided at ``at``, serving at
    ``ready_at`` unless cancelled first."""

    replica_id: str
    at: float
    ready_at: float
    is_warm: bool


@dataclass(frozen=True, slots=True)
class Drain:
    """One replica drained: out of the ring at ``at``, stopped at ``stopped_at``;
    ``errors`` streams were still running at the deadline."""

    replica_id: str
    at: float
    stopped_at: float
    errors: int


@dataclass(frozen=True, slots=True)
class ScalingTick:
    """One call of the policy (its signals are the pool around it)."""

    decision: ScalingDecision


@dataclass(slots=True)
class _Bill:
    kind: str  # "replica" or "warm"
    since: float
    until: float | None = None


@dataclass(slots=True)
class ScalingLog:
    """Everything the autoscaling did in a run (``FleetResult.scaling``)."""

    gpus_per_replica: int
    ticks: list[ScalingTick] = field(default_factory=list)
    starts: list[ReplicaStart] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    drains: list[Drain] = field(default_factory=list)
    bills: list[_Bill] = field(default_factory=list)

    def gpu_hours(self, start_s: float, end_s: float) -> tuple[float, float]:
        """Return GPU-hours billed in ``[start_s, end_s]``: (replicas, warm pool)."""
        totals = {"replica": 0.0, "warm": 0.0}
        for bill in self.bills:
            until = end_s if bill.until is None else min(bill.until, end_s)
            since = max(bill.since, start_s)
            if until > since:
                totals[bill.kind] += until - since
        scale = self.gpus_per_replica / 3600.0
        return totals["replica"] * scale, totals["warm"] * scale


@dataclass(slots=True)
class _Starting:
    ready_at: float
    weights_at: float  # from then on the node has the weights on its disk


class FleetScaler:
    """The autoscaler's state and the machinery's bookkeeping, for one ``FleetSim``.

    The simulator is its one caller: it asks ``decide`` every interval and reports
    what it did (``start``, ``cancel``, ``drain``, ``stop``, ``joins``) and what
    starts are in progress (``unready``).
    """

    def __init__(
        self,
        autoscaling: FleetAutoscaling,
        *,
        replica_tokens_in_flight: int,
        gpus_per_replica: int,
        replicas: Iterable[str],
    ) -> None:
        self.autoscaling = autoscaling
        self.replica_tokens_in_flight = replica_tokens_in_flight
        self.gpus_per_replica = gpus_per_replica
        self.log = ScalingLog(gpus_per_replica=gpus_per_replica)
        self._state = AutoscalerState()
        self._starting: dict[str, _Starting] = {}
        self._cancelled: set[str] = set()
        self._draining: dict[str, float] = {}
        self._replica_bill: dict[str, _Bill] = {}
        self._warm_ready: list[_Bill] = []
        self._provisioning: list[tuple[float, _Bill]] = []  # (ready for the pool at)
        for replica_id in replicas:
            self._replica_bill[replica_id] = self._open("replica", 0.0)
        self._warm_target = autoscaling.warm_nodes
        for _ in range(autoscaling.warm_nodes):
            self._warm_ready.append(self._open("warm", 0.0))

    # -- the policy ----------------------------------------------------------------------

    def decide(
        self,
        now: float,
        *,
        serving: int,
        tokens_in_flight: int,
        queued: Sequence[Candidate],
    ) -> ScalingDecision:
        """Observe the pool, call the platform's policy, and log the tick."""
        self._settle(now)
        autoscaling = self.autoscaling
        alive = serving + len(self._starting) + len(self._draining)
        signals = PoolSignals(
            at=now,
            serving=serving,
            starting=len(self._starting),
            tokens_in_flight=tokens_in_flight,
            queued_tokens=sum(candidate.tokens for candidate in queued),
            queue_depth=len(queued),
            replica_tokens_in_flight=self.replica_tokens_in_flight,
            capacity_is_assumed=autoscaling.capacity_is_assumed,
            gpus_per_replica=self.gpus_per_replica,
            free_gpus=max(0, autoscaling.gpu_budget - alive * self.gpus_per_replica),
        )
        decision, self._state = decide(autoscaling.settings, self._state, signals)
        self.log.ticks.append(ScalingTick(decision=decision))
        if autoscaling.settings.warm_nodes_max > 0:
            self._resize_warm(decision.warm_nodes, now)
        return decision

    # -- what the simulator did ------------------------------------------------------------

    def start(self, replica_id: str, now: float) -> ReplicaStart:
        """Start a replica: on a warm node when the pool has one, else cold."""
        self._settle(now)
        cold = self.autoscaling.cold_start
        is_warm = bool(self._warm_ready)
        if is_warm:
            bill = self._warm_ready.pop(0)
            bill.until = now  # the node leaves the pool and carries the replica
            ready_at, weights_at = now + cold.warm_s, now
            self._refill(now)
        else:
            ready_at = now + cold.cold_s
            weights_at = now + cold.provision_s
        self._replica_bill[replica_id] = self._open("replica", now)
        self._starting[replica_id] = _Starting(ready_at=ready_at, weights_at=weights_at)
        record = ReplicaStart(replica_id, now, ready_at, is_warm)
        self.log.starts.append(record)
        return record

    def joins(self, replica_id: str) -> bool:
        """Say whether a replica whose start ended may join the ring (False when
        the start was cancelled)."""
        if replica_id in self._cancelled:
            self._cancelled.discard(replica_id)
            return False
        self._starting.pop(replica_id, None)
        return True

    def unready(self, now: float) -> list[tuple[str, ReplicaState]]:
        """Return the starts in progress and their state as the agent would beat
        it: ``starting`` until the node has the weights on its disk, then
        ``loading``."""
        return [
            (
                replica_id,
                ReplicaState.STARTING
                if now < starting.weights_at
                else ReplicaState.LOADING,
            )
            for replica_id, starting in self._starting.items()
        ]

    def cancel(self, replica_id: str, now: float) -> None:
        """Cancel the start of ``replica_id`` (it will not join the ring)."""
        starting = self._starting.pop(replica_id)
        self._cancelled.add(replica_id)
        self.log.cancelled.append(replica_id)
        self._release(replica_id, now, has_weights=now >= starting.weights_at)

    def drain(self, replica_id: str, now: float) -> None:
        """A serving replica left the ring to drain."""
        self._draining[replica_id] = now

    def stop(self, replica_id: str, now: float, *, errors: int = 0) -> None:
        """A draining replica stopped (``errors`` streams cut at its deadline)."""
        at = self._draining.pop(replica_id)
        self.log.drains.append(Drain(replica_id, at, now, errors))
        self._release(replica_id, now, has_weights=True)

    # -- the node pool -------------------------------------------------------------------

    def _open(self, kind: str, now: float) -> _Bill:
        bill = _Bill(kind, now)
        self.log.bills.append(bill)
        return bill

    def _settle(self, now: float) -> None:
        """Move provisioned nodes whose weights have landed into the warm pool."""
        while self._provisioning and self._provisioning[0][0] <= now:
            _ready_at, bill = self._provisioning.pop(0)
            self._warm_ready.append(bill)

    def _resize_warm(self, target: int, now: float) -> None:
        """Move the warm pool to ``target`` nodes: provision the shortfall, or
        release the surplus (provisioning nodes first, newest first)."""
        self._warm_target = target
        surplus = len(self._warm_ready) + len(self._provisioning) - target
        while surplus > 0 and self._provisioning:
            _ready_at, newest = self._provisioning.pop()
            newest.until = now
            surplus -= 1
        while surplus > 0 and self._warm_ready:
            self._warm_ready.pop().until = now
            surplus -= 1
        self._refill(now)

    def _refill(self, now: float) -> None:
        short = self._warm_target - len(self._warm_ready)
        for _ in range(short - len(self._provisioning)):
            ready_at = now + self.autoscaling.cold_start.provision_s
            self._provisioning.append((ready_at, self._open("warm", now)))

    def _release(self, replica_id: str, now: float, *, has_weights: bool) -> None:
        """A replica's node is free: back to the warm pool if it is short, else
        released; a node given back makes the newest refill unnecessary."""
        bill = self._replica_bill.pop(replica_id, None)
        if bill is not None:
            bill.until = now
        self._settle(now)
        if not has_weights or len(self._warm_ready) >= self._warm_target:
            return
        self._warm_ready.append(self._open("warm", now))
        if len(self._warm_ready) + len(self._provisioning) > self._warm_target:
            _ready_at, newest = self._provisioning.pop()
            newest.until = now
