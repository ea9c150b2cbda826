"""The replica rows a pool's pods call for: one per pod, keyed by the pod's name.

Public surface: ``PodFacts``, ``ReplicaRow``, ``PodReplica``, ``PodsPlan``,
``plan_pod_replicas``.

On Kubernetes no node agent registers replicas; the actuator's beat loop
(``engine_nodes.kubernetes_beats``) lists each pool's pods every beat and writes
what this policy decides. A pod is ``starting`` until Ready, then ``serving``;
``draining`` once the drain stamped it (``platform/draining-since``) or it is
terminating. Two states are never left here: ``draining`` (the drain owns
draining -> serving, ``KubernetesActuator``'s undrain) and ``gone`` (the reaper
gave up on it: as for a node agent's replica, a late pod does not revive it).
A row whose pod is no longer listed is removed. A pod of a version with KV
events records where it publishes them (``kv_events_url``, on its IP) beside its
``url``. See ``docs/kubernetes-pools.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine_nodes.domain.k8s_drain import DRAINING_SINCE_ANNOTATION
from engine_nodes.domain.liveness import ReplicaState
from engine_nodes.domain.replica_argv import kv_events_url

__all__ = [
    "PodFacts",
    "PodReplica",
    "PodsPlan",
    "ReplicaRow",
    "plan_pod_replicas",
]

# States a pod's row keeps whatever the pod shows (see the module docstring).
_STICKY = (ReplicaState.DRAINING, ReplicaState.GONE)


@dataclass(frozen=True, slots=True)
class PodFacts:
    """A pod as listed: what the policy reads of it."""

    name: str
    phase: str
    is_ready: bool
    pod_ip: str | None = None
    node: str = ""
    is_terminating: bool = False
    annotations: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """A replica row as read from the database."""

    state: str
    url: str = ""
    node: str = ""
    kv_events_url: str = ""


@dataclass(frozen=True, slots=True)
class PodReplica:
    """The row one pod calls for, and the row as it was (``was``: None if absent)."""

    replica_id: str
    node: str
    url: str
    state: ReplicaState
    was: ReplicaRow | None = None
    kv_events_url: str = ""

    @property
    def is_changed(self) -> bool:
        """True when the row must be written (created, or a field moved)."""
        was = self.was
        return was is None or (
            was.state,
            was.url,
            was.node,
            was.kv_events_url,
        ) != (self.state, self.url, self.node, self.kv_events_url)


@dataclass(frozen=True, slots=True)
class PodsPlan:
    """One pool's rows: one per listed pod, and the ids of rows whose pod is gone."""

    replicas: tuple[PodReplica, ...]
    removed: tuple[str, ...]


def plan_pod_replicas(
    *,
    deployment: str,
    port: int,
    pods: Sequence[PodFacts],
    rows: Mapping[str, ReplicaRow],
    kv_events_port: int = 0,
) -> PodsPlan:
    """Return the rows ``pods`` call for, given the pool's ``rows`` by replica id.

    ``deployment``: the pool's Deployment name; only rows named after it (its pods
    are ``<deployment>-<hash>-<suffix>``) are the pool's, so rows a node agent
    registered are never removed here. ``port``: the engine's port in the
    rendered Deployment; ``kv_events_port``: its KV events' port (0: none). A pod
    without an IP yet has no URL (and no ``kv_events_url``).
    """
    listed = {pod.name for pod in pods}
    replicas = tuple(
        _replica_of(
            pod, port=port, kv_events_port=kv_events_port, was=rows.get(pod.name)
        )
        for pod in sorted(pods, key=lambda p: p.name)
    )
    removed = tuple(
        sorted(
            replica_id
            for replica_id in rows
            if replica_id.startswith(f"{deployment}-") and replica_id not in listed
        )
    )
    return PodsPlan(replicas=replicas, removed=removed)


def _replica_of(
    pod: PodFacts, *, port: int, kv_events_port: int, was: ReplicaRow | None
) -> PodReplica:
    url = f"http://{pod.pod_ip}:{port}" if pod.pod_ip else ""
    events = (
        kv_events_url(pod.pod_ip, kv_events_port)
        if pod.pod_ip and kv_events_port
        else ""
    )
    return PodReplica(
        replica_id=pod.name,
        node=pod.node,
        url=url,
        kv_events_url=events,
        state=_state_of(pod, was),
        was=was,
    )


def _state_of(pod: PodFacts, was: ReplicaRow | None) -> ReplicaState:
    if was is not None and was.state in _STICKY:
        return ReplicaState(was.state)
    annotations = pod.annotations or {}
    if pod.is_terminating or annotations.get(DRAINING_SINCE_ANNOTATION):
        return ReplicaState.DRAINING
    if pod.is_ready and pod.phase == "Running" and pod.pod_ip:
        return ReplicaState.SERVING
    return ReplicaState.STARTING
