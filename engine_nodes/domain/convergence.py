"""How a pool converges to its target size: which replicas to add, which to drain.

Public surface: ``ReplicaView``, ``Convergence``, ``Step``, ``converge``,
``converge_steps`` and its effects ``StartReplica``, ``CancelReplica``,
``DrainReplica``.

The autoscaler (``models_registry.domain.autoscaler``) decides how many replicas a pool
wants; this module decides, each time a node agent reconciles, what to do about
the difference, so that no stream is cut by a scale-down:

- **Starting replicas count.** ``starting`` and ``loading`` replicas count toward
  the target as serving ones do: a pool never starts more than its target while
  some are still loading. Draining replicas do not count (they are leaving).
- **Unready replicas go first.** Above target, replicas that never served
  (``starting``, then ``loading``; newest first) are cancelled at once, all of
  them if need be: they carry no stream. Kubernetes' ReplicaSet removes unready
  pods first for the same reason.
- **One drain at a time.** Past those, one replica is drained (it leaves the ring,
  its streams finish or its drain deadline passes, then it stops), and no other of
  the pool while one drains: capacity falls one replica per drain, so the rest
  absorb what new traffic the drained one would have had.
- **Only when the others serving are enough.** A serving replica is drained only
  if the serving replicas left (silent ones not counted) still make the target;
  else the pool waits (a silent replica is reaped, a loading one comes up).
- **Which one: a stalled replica, else the least loaded, ties to the newest.**
  Draining a stalled replica costs no serving capacity. Among serving replicas,
  the one with the fewest tokens in flight has the fewest streams to finish, so
  its drain ends soonest and, if the deadline passes, ends the fewest streams
  with an error; between equals, the newest has the least warm prefix cache.

Pure: the caller passes what the database holds, or what the fleet simulator
models. ``converge_steps`` is the step written once as a generator of effects (the
shape of ``routing.domain.admission_control``): it yields ``CancelReplica``,
``DrainReplica`` and ``StartReplica``, each answered with whether it was done, and
returns the ``Convergence``. The node agent's reconcile
(``engine_nodes.services.reconcile_pools``) performs them on the database, the
fleet simulator (``drills.domain.fleet``) on its modelled replicas in virtual time,
so a drill measures this code, not a copy of it.
"""

from __future__ import annotations

import enum
from collections.abc import Generator, Sequence
from dataclasses import dataclass

from engine_nodes.domain.liveness import ReplicaState

__all__ = [
    "CancelReplica",
    "Convergence",
    "DrainReplica",
    "Effect",
    "ReplicaView",
    "StartReplica",
    "Step",
    "Steps",
    "converge",
    "converge_steps",
]

_UNREADY = (ReplicaState.STARTING, ReplicaState.LOADING)
_LEAVING = (ReplicaState.DRAINING, ReplicaState.GONE)


class Step(enum.StrEnum):
    """What a reconcile does about a pool, and why."""

    CONVERGED = "converged"  # at target
    START = "start"  # short: start replicas
    CANCEL = "cancel"  # above target: cancel replicas that never served
    DRAIN = "drain"  # above target: drain one replica
    WAIT_DRAINING = "wait_draining"  # above target, but one already drains
    WAIT_SERVING = "wait_serving"  # above target, but the others are not enough


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica of the pool as the control plane sees it.

    ``tokens_in_flight`` is from its last beat; ``created_at`` is any clock whose
    larger values are newer; ``is_silent``: it missed its beats (not yet reaped).
    """

    replica_id: str
    state: str
    tokens_in_flight: int = 0
    created_at: float = 0.0
    is_silent: bool = False


@dataclass(frozen=True, slots=True)
class Convergence:
    """What to do about one pool: replicas to start and replica ids to drain.

    ``drain`` holds at most one replica that served; the others in it (if any)
    never served and are cancelled.
    """

    step: Step
    start: int = 0
    drain: tuple[str, ...] = ()


def converge(target: int, replicas: Sequence[ReplicaView]) -> Convergence:
    """Return how the pool of ``replicas`` moves toward ``target`` replicas."""
    if target < 0:
        raise ValueError("target must be zero or more")
    active = [r for r in replicas if r.state not in _LEAVING]
    surplus = len(active) - target
    if surplus < 0:
        return Convergence(Step.START, start=-surplus)
    if surplus == 0:
        return Convergence(Step.CONVERGED)
    unready = sorted(
        (r for r in active if r.state in _UNREADY),
        key=lambda r: (_UNREADY.index(ReplicaState(r.state)), -r.created_at),
    )
    cancelled = tuple(r.replica_id for r in unready[:surplus])
    if cancelled:
        return Convergence(Step.CANCEL, drain=cancelled)
    if any(r.state == ReplicaState.DRAINING for r in replicas):
        return Convergence(Step.WAIT_DRAINING)
    healthy = [r for r in active if not r.is_silent]
    stalled = [r for r in healthy if r.state == ReplicaState.STALLED]
    serving = [r for r in healthy if r.state == ReplicaState.SERVING]
    if stalled:
        chosen = min(stalled, key=_drain_order)
    elif serving and len(serving) - 1 >= target:
        chosen = min(serving, key=_drain_order)
    else:
        return Convergence(Step.WAIT_SERVING)
    return Convergence(Step.DRAIN, drain=(chosen.replica_id,))


@dataclass(frozen=True, slots=True)
class CancelReplica:
    """Give up ``replica_id``, which never served (it carries no stream)."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class DrainReplica:
    """Take ``replica_id`` out of the ring; it stops once its streams end or its
    drain deadline passes."""

    replica_id: str


@dataclass(frozen=True, slots=True)
class StartReplica:
    """Start one more replica of the pool."""


Effect = CancelReplica | DrainReplica | StartReplica
# Each effect is answered with whether the driver did it: a replica's state changed
# meanwhile (compare-and-set lost) or no GPU is left for a start.
Steps = Generator[Effect, bool, Convergence]


def converge_steps(target: int, replicas: Sequence[ReplicaView]) -> Steps:
    """Yield what moves ``replicas`` toward ``target``; return the ``Convergence``.

    Cancels and the drain come first (a convergence never both starts and drains);
    starts stop at the first one the driver could not do (no GPU left), so a
    driver's answer is the only way the count falls short.
    """
    plan = converge(target, replicas)
    if plan.step == Step.CANCEL:
        for replica_id in plan.drain:
            yield CancelReplica(replica_id)
    elif plan.step == Step.DRAIN:
        yield DrainReplica(plan.drain[0])
    for _ in range(plan.start):
        if not (yield StartReplica()):
            break
    return plan


def _drain_order(replica: ReplicaView) -> tuple[int, float, str]:
    # Least loaded first; between equals the newest, then a stable tie-break.
    return (replica.tokens_in_flight, -replica.created_at, replica.replica_id)
