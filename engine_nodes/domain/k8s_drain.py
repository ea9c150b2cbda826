"""A pool's Deployment scaled down without cutting a stream: which pod leaves, and when.

Public surface: ``PodView``, ``ReplicaLoad``, ``PoolFacts``, ``Step``, ``Decision``,
``decide``, ``drain_steps`` and its effects ``Scale``, ``MarkDraining``,
``MarkServing``, ``AnnotatePod``; ``InMemoryPool``, the in-memory interpreter.

Left alone, a Deployment scale-down lets the ReplicaSet controller pick the pod
that dies, streams and all. Here one tick of a pool decides, from the facts:

- **Up: directly.** Below target, the Deployment is scaled to it.
- **Unready first.** Above target with a pod not ready (starting, loading): scale
  down by one at once. The controller removes unready pods before any ready one,
  whatever their deletion cost, and such a pod carries no stream.
- **Down: one drained pod at a time.** Choose the replica to leave (a stalled one,
  else the fewest streams, then tokens in flight, ties to the newest), mark it
  draining (out of every gateway's ring); wait until it holds no stream (and the
  gateways' snapshots have caught up, ``settle_s``) or ``drain_timeout_s`` passes;
  then set its ``controller.kubernetes.io/pod-deletion-cost`` to ``DRAINED_COST``
  (the others keep the default 0) and only then lower ``replicas`` by one, so the
  controller removes that pod. A stream still open at the deadline ends with the
  gateway's error event when the pod stops, as on a node agent.
- **Wait** while a pod terminates, while a rollout moves ReplicaSets, or while no
  other ready replica would be left to carry the target.
- **Back up.** A pod draining while the target rose again is marked serving
  (only once the controller has no pod left to remove: it may be that one).

``drain_steps`` is that tick as a generator of effects (the shape of
``routing.domain.admission_control``): the live interpreter
(``engine_nodes.kubernetes_actuator.KubernetesActuator``) performs them on the
Kubernetes API and the platform's database; ``InMemoryPool`` on a modelled pool.

Heartbeats: a pod's streams come from its replica's beats, keyed by pod name; the
intended source is a watcher on the pods plus ``/metrics`` scrapes in the actuator's
process, not built yet. Without a fresh beat a pod's streams are unknown (never
zero), so it drains to its deadline. See ``docs/kubernetes-pools.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Generator
from dataclasses import dataclass, field, replace

from engine_nodes.domain.liveness import ReplicaState

__all__ = [
    "DELETION_COST_ANNOTATION",
    "DRAINED_COST",
    "DRAINING_SINCE_ANNOTATION",
    "AnnotatePod",
    "Decision",
    "Effect",
    "InMemoryPool",
    "MarkDraining",
    "MarkServing",
    "PodView",
    "PoolFacts",
    "ReplicaLoad",
    "Scale",
    "Step",
    "Steps",
    "decide",
    "drain_steps",
]

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
# When the actuator marked the pod's replica draining (seconds since the epoch): the
# drain's clock lives on the pod, so a restarted actuator keeps the deadline.
DRAINING_SINCE_ANNOTATION = "platform/draining-since"
DRAINED_COST = -1000


@dataclass(frozen=True, slots=True)
class PodView:
    """One pod of the pool and its replica, as the actuator last saw them.

    ``state`` is its replica's (``ReplicaState``); ``streams`` is None when no
    fresh beat says how many it holds (never taken for zero). ``draining_since``
    is the pod's ``DRAINING_SINCE_ANNOTATION``; ``created_at`` any clock where
    larger is newer.
    """

    pod: str
    replica_id: str
    state: str = ReplicaState.SERVING
    is_ready: bool = True
    is_terminating: bool = False
    streams: int | None = 0
    tokens_in_flight: int = 0
    created_at: float = 0.0
    draining_since: float | None = None
    deletion_cost: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What the platform knows of a pod's replica: its state and its streams.

    ``streams`` is None when no fresh beat says (the replica is silent).
    """

    state: str
    streams: int | None
    tokens_in_flight: int = 0


@dataclass(frozen=True, slots=True)
class PoolFacts:
    """What one tick of a pool decides on; ``now`` on the same clock as the pods'."""

    replicas: int  # the Deployment's spec.replicas
    target: int  # Pool.target_replicas
    pods: tuple[PodView, ...]
    now: float
    drain_timeout_s: float
    settle_s: float = 0.0
    is_rolling_out: bool = False


class Step(enum.StrEnum):
    """What a tick did about the pool, and why."""

    CONVERGED = "converged"
    SCALE_UP = "scale_up"
    REMOVE_UNREADY = "remove_unready"  # scaled down by one: an unready pod goes
    MARK_DRAINING = "mark_draining"
    WAIT_DRAINING = "wait_draining"  # the chosen replica still holds streams
    REMOVE_DRAINED = "remove_drained"  # annotated, then scaled down by one
    WAIT_TERMINATING = "wait_terminating"
    WAIT_ROLLOUT = "wait_rollout"
    WAIT_SERVING = "wait_serving"  # no replica can leave without falling short
    UNDRAIN = "undrain"


@dataclass(frozen=True, slots=True)
class Decision:
    """One tick's decision: its step, the pod it concerns, and its deadline."""

    step: Step
    pod: str | None = None
    replicas: int | None = None
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Scale:
    """Set the Deployment's ``spec.replicas`` (its scale subresource)."""

    replicas: int


@dataclass(frozen=True, slots=True)
class MarkDraining:
    """Take ``replica_id`` out of every ring; stamp its pod ``at`` (drain start)."""

    replica_id: str
    pod: str
    at: float


@dataclass(frozen=True, slots=True)
class MarkServing:
    """Put a draining ``replica_id`` back in the rings; clear its pod's marks."""

    replica_id: str
    pod: str


@dataclass(frozen=True, slots=True)
class AnnotatePod:
    """Set the pod's ``controller.kubernetes.io/pod-deletion-cost``."""

    pod: str
    cost: int


Effect = Scale | MarkDraining | MarkServing | AnnotatePod
# Each effect is answered with whether it was done (a compare-and-set lost: the
# replica changed state meanwhile); a tick stops at the first one not done.
Steps = Generator[Effect, bool, Decision]

_LEAVING = (ReplicaState.DRAINING, ReplicaState.GONE)


def decide(facts: PoolFacts) -> Decision:
    """Return what the tick does about the pool described by ``facts``."""
    if facts.target < 0:
        raise ValueError("target must be zero or more")
    alive = [p for p in facts.pods if not p.is_terminating]
    draining = [p for p in alive if p.draining_since is not None]
    if facts.replicas < facts.target:
        return Decision(Step.SCALE_UP, replicas=facts.target)
    if len(alive) > facts.replicas:
        # The controller has yet to remove a pod (the last scale-down): the
        # draining one may be it, so it is neither undrained nor counted.
        return Decision(Step.WAIT_TERMINATING)
    if facts.replicas == facts.target:
        marked = draining or [p for p in alive if p.state == ReplicaState.DRAINING]
        if marked:
            return Decision(Step.UNDRAIN, pod=marked[0].pod)
        return Decision(Step.CONVERGED)
    return _decide_down(facts, alive, draining)


def _decide_down(
    facts: PoolFacts, alive: list[PodView], draining: list[PodView]
) -> Decision:
    """Return the step of a pool above its target."""
    if facts.is_rolling_out:
        return Decision(Step.WAIT_ROLLOUT)
    if any(p.is_terminating for p in facts.pods):
        return Decision(Step.WAIT_TERMINATING)
    down = facts.replicas - 1
    if any(not p.is_ready for p in alive) or len(alive) < facts.replicas:
        # Pending or unready pods go first whatever their cost (ReplicaSet order).
        return Decision(Step.REMOVE_UNREADY, replicas=down)
    if draining:
        pod = min(draining, key=lambda p: (p.draining_since, p.pod))
        assert pod.draining_since is not None
        deadline = pod.draining_since + facts.drain_timeout_s
        settled = facts.now >= pod.draining_since + facts.settle_s
        if (pod.streams == 0 and settled) or facts.now >= deadline:
            return Decision(Step.REMOVE_DRAINED, pod=pod.pod, replicas=down)
        return Decision(Step.WAIT_DRAINING, pod=pod.pod, deadline=deadline)
    # Marked draining but not stamped (the actuator stopped between the two):
    # it is out of the rings already, so it is the one to leave; stamp it.
    unstamped = [p for p in alive if p.state == ReplicaState.DRAINING]
    candidates = unstamped[:1] or [p for p in alive if p.state not in _LEAVING]
    stalled = [p for p in candidates if p.state == ReplicaState.STALLED]
    serving = [p for p in candidates if p.state == ReplicaState.SERVING]
    if unstamped:
        chosen = unstamped[0]
    elif stalled:
        chosen = min(stalled, key=_leave_order)
    elif serving and len(serving) - 1 >= facts.target:
        chosen = min(serving, key=_leave_order)
    else:
        return Decision(Step.WAIT_SERVING)
    return Decision(
        Step.MARK_DRAINING,
        pod=chosen.pod,
        deadline=facts.now + facts.drain_timeout_s,
    )


def drain_steps(facts: PoolFacts) -> Steps:
    """Yield the effects of one tick of the pool; return its ``Decision``.

    The deletion cost is set before the scale, never after: the controller picks
    the pod to remove when ``replicas`` falls.
    """
    decision = decide(facts)
    pods = {p.pod: p for p in facts.pods}
    if decision.step in (Step.SCALE_UP, Step.REMOVE_UNREADY):
        assert decision.replicas is not None
        yield Scale(decision.replicas)
    elif decision.step == Step.MARK_DRAINING:
        assert decision.pod is not None
        pod = pods[decision.pod]
        yield MarkDraining(pod.replica_id, pod.pod, at=facts.now)
    elif decision.step == Step.REMOVE_DRAINED:
        assert decision.pod is not None and decision.replicas is not None
        if (yield AnnotatePod(decision.pod, DRAINED_COST)):
            yield Scale(decision.replicas)
    elif decision.step == Step.UNDRAIN:
        assert decision.pod is not None
        pod = pods[decision.pod]
        if (yield AnnotatePod(pod.pod, 0)):
            yield MarkServing(pod.replica_id, pod.pod)
    return decision


def _leave_order(pod: PodView) -> tuple[int, int, float, str]:
    # Fewest streams (unknown counts as many), fewest tokens, then the newest.
    streams = pod.streams if pod.streams is not None else 2**31
    return (streams, pod.tokens_in_flight, -pod.created_at, pod.pod)


@dataclass
class InMemoryPool:
    """A modelled pool that performs ``drain_steps``' effects, for tests and drills.

    Pods are removed as the ReplicaSet controller removes them on a scale-down
    (lowest deletion cost first, then the newest); a pod removed with streams
    open ends each with the gateway's error event (``cut``). Streams are counted
    per pod; ``created`` names new pods ``<prefix>-<n>``.
    """

    replicas: int
    pods: dict[str, PodView] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    cut: dict[str, int] = field(default_factory=dict)
    prefix: str = "pod"
    _created: int = 0

    def add_pod(self, *, now: float, streams: int = 0) -> str:
        """Start a ready, serving pod at ``now``; return its name."""
        self._created += 1
        name = f"{self.prefix}-{self._created}"
        self.pods[name] = PodView(
            pod=name, replica_id=name, streams=streams, created_at=now
        )
        return name

    def set_streams(self, pod: str, streams: int) -> None:
        """Say how many streams ``pod`` holds now."""
        self.pods[pod] = replace(self.pods[pod], streams=streams)

    def facts(
        self, *, target: int, now: float, drain_timeout_s: float, settle_s: float = 0
    ) -> PoolFacts:
        """Return the pool's facts for one tick."""
        return PoolFacts(
            replicas=self.replicas,
            target=target,
            pods=tuple(self.pods.values()),
            now=now,
            drain_timeout_s=drain_timeout_s,
            settle_s=settle_s,
        )

    def run(self, steps: Steps, *, now: float) -> Decision:
        """Perform every effect of ``steps``; return the tick's decision."""
        answer: bool | None = None
        while True:
            try:
                effect = next(steps) if answer is None else steps.send(answer)
            except StopIteration as stop:
                decision: Decision = stop.value
                return decision
            answer = self.apply(effect, now=now)

    def apply(self, effect: Effect, *, now: float) -> bool:
        """Perform one effect; return whether it was done."""
        if isinstance(effect, Scale):
            self.replicas = effect.replicas
            while len(self.pods) > self.replicas:
                self._remove(min(self.pods.values(), key=_deletion_order).pod)
            while len(self.pods) < self.replicas:
                self.add_pod(now=now)
            return True
        if effect.pod not in self.pods:
            return False
        pod = self.pods[effect.pod]
        if isinstance(effect, AnnotatePod):
            self.pods[effect.pod] = replace(pod, deletion_cost=effect.cost)
        elif isinstance(effect, MarkDraining):
            if pod.state not in (ReplicaState.SERVING, ReplicaState.STALLED):
                return False
            self.pods[effect.pod] = replace(
                pod, state=ReplicaState.DRAINING, draining_since=effect.at
            )
        else:
            self.pods[effect.pod] = replace(
                pod, state=ReplicaState.SERVING, draining_since=None
            )
        return True

    def _remove(self, name: str) -> None:
        pod = self.pods.pop(name)
        self.removed.append(name)
        if pod.streams:
            self.cut[name] = pod.streams


def _deletion_order(pod: PodView) -> tuple[bool, int, float, str]:
    # The ReplicaSet controller's order, as far as it matters here: unready first,
    # then the lowest deletion cost, then the newest.
    return (pod.is_ready, pod.deletion_cost, -pod.created_at, pod.pod)
