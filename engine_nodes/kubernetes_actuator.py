"""Keep each pool's Deployment at its target on Kubernetes, draining before a scale-down.

``KubernetesActuator`` manages one Deployment per pool through an ``AppsV1Api``-like
object that the caller builds; this module never imports the ``kubernetes``
package, so the platform runs without it. ``follow_pool`` keeps a Deployment's
replicas at the pool's target (``engine_nodes.services.follow_pools_on_kubernetes``
passes ``Pool.target_replicas``), with a scale patch when only the count moved.
Given a ``CoreV1Api``-like object and a ``ReplicaLedger`` (the platform's
replicas), it never lets the ReplicaSet controller pick the pod a scale-down
removes: it interprets ``engine_nodes.domain.k8s_drain.drain_steps`` (drain the
chosen pod's replica, set its pod-deletion-cost, then scale down by one). See
``docs/kubernetes-pools.md``.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from engine_nodes.domain.k8s import (
    SPEC_DIGEST_ANNOTATION,
    FollowAction,
    PoolSpec,
    follow_action,
    pool_labels,
    render_deployment,
    scale_body,
)
from engine_nodes.domain.k8s_drain import (
    DELETION_COST_ANNOTATION,
    DRAINING_SINCE_ANNOTATION,
    AnnotatePod,
    Decision,
    Effect,
    MarkDraining,
    PodView,
    PoolFacts,
    ReplicaLoad,
    Scale,
    Step,
    drain_steps,
)
from engine_nodes.domain.k8s_pods import PodFacts
from engine_nodes.domain.k8s_warm import render_warm_nodes
from engine_nodes.domain.liveness import ReplicaState

__all__ = [
    "AppsV1Like",
    "CoreV1Like",
    "DrainOptions",
    "KubernetesActuator",
    "ReplicaLedger",
    "list_pod_facts",
    "pod_facts",
]

logger = logging.getLogger(__name__)


class AppsV1Like(Protocol):
    """The part of ``kubernetes.client.AppsV1Api`` the actuator uses.

    Absent objects raise an exception whose ``status`` is 404, as
    ``kubernetes.client.exceptions.ApiException`` does.
    """

    def read_namespaced_deployment(self, name: str, namespace: str) -> Any: ...

    def create_namespaced_deployment(self, namespace: str, body: Any) -> Any: ...

    def patch_namespaced_deployment(
        self, name: str, namespace: str, body: Any
    ) -> Any: ...

    def patch_namespaced_deployment_scale(
        self, name: str, namespace: str, body: Any
    ) -> Any: ...

    def delete_namespaced_deployment(self, name: str, namespace: str) -> Any: ...


class CoreV1Like(Protocol):
    """The part of ``kubernetes.client.CoreV1Api`` the drain uses (pods: list, patch)."""

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> Any: ...

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any) -> Any: ...


class ReplicaLedger(Protocol):
    """The platform's side of a drain: its replicas, keyed by pod name."""

    def loads(self, replica_ids: Collection[str]) -> Mapping[str, ReplicaLoad]:
        """Return what is known of each replica (absent: no row, no beat)."""
        ...

    def mark_draining(self, replica_id: str) -> bool:
        """Take the replica out of every gateway's ring; False if it moved meanwhile."""
        ...

    def mark_serving(self, replica_id: str) -> bool:
        """Put a draining replica back in the rings; False if it moved meanwhile."""
        ...


@dataclass(frozen=True, slots=True)
class DrainOptions:
    """How a Deployment scale-down drains: the deadline, the settle time, retries.

    ``settle_s``: how long a drained replica stays after its last stream, so the
    gateways' snapshots have dropped it; ``conflict_retries``: reads and decides
    again after this many 409s (another writer moved the Deployment meanwhile).
    """

    drain_timeout_s: float
    settle_s: float = 0.0
    conflict_retries: int = 3

    def __post_init__(self) -> None:
        if self.drain_timeout_s <= 0:
            raise ValueError("the drain deadline must be positive")
        if self.settle_s < 0 or self.conflict_retries < 0:
            raise ValueError("settle_s and conflict_retries must not be negative")


class _Conflict(Exception):
    """A write lost to another writer (409): read again, decide again."""


class KubernetesActuator:
    """Keep one Deployment per pool in ``namespace`` equal to its ``PoolSpec``.

    Build it with ``KubernetesActuator(kubernetes.client.AppsV1Api(), "serving")``
    after ``kubernetes.config.load_incluster_config()`` (or a kubeconfig). With
    ``core`` (a ``CoreV1Api``), ``ledger`` and ``drain``, a scale-down drains the
    pod that leaves first (``engine_nodes.domain.k8s_drain``); without them,
    Kubernetes picks the pod, as before.
    """

    def __init__(
        self,
        api: AppsV1Like,
        namespace: str,
        *,
        core: CoreV1Like | None = None,
        ledger: ReplicaLedger | None = None,
        drain: DrainOptions | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if (core is None) != (ledger is None) or (core is None) != (drain is None):
            raise ValueError("core, ledger and drain go together")
        self.api = api
        self.namespace = namespace
        self.core = core
        self.ledger = ledger
        self.drain = drain
        self.clock = clock

    def apply_pool(self, spec: PoolSpec) -> str:
        """Create the pool's Deployment, or patch it if it exists; return its name.

        A create that loses a race to another writer (409) falls back to a patch.
        """
        manifest = render_deployment(namespace=self.namespace, spec=spec)
        name: str = manifest["metadata"]["name"]
        try:
            self.api.read_namespaced_deployment(name=name, namespace=self.namespace)
        except Exception as exc:
            if _status(exc) != 404:
                raise
            try:
                self.api.create_namespaced_deployment(
                    namespace=self.namespace, body=manifest
                )
            except Exception as create_exc:
                if _status(create_exc) != 409:
                    raise
            else:
                logger.info("created deployment %s/%s", self.namespace, name)
                return name
        self.api.patch_namespaced_deployment(
            name=name, namespace=self.namespace, body=manifest
        )
        logger.info("patched deployment %s/%s", self.namespace, name)
        return name

    def scale_pool(
        self, name: str, replicas: int, *, resource_version: str | None = None
    ) -> None:
        """Set the Deployment's replica count through its scale subresource.

        With ``resource_version``, the API refuses (409) if the Deployment changed
        since it was read at that version.
        """
        body = scale_body(replicas)
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        self.api.patch_namespaced_deployment_scale(
            name=name, namespace=self.namespace, body=body
        )

    def follow_pool(self, spec: PoolSpec) -> FollowAction:
        """Bring the pool's Deployment to ``spec`` (its replicas included); say how.

        One read, then at most one write: a create, a whole patch when the
        manifest changed beyond its replica count, or a scale patch when only the
        count differs (``engine_nodes.domain.k8s.follow_action``). A create that
        loses a race to another writer (409) falls back to a whole patch. With a
        drain, a whole patch keeps the live count when it is above the target, and
        the count moves by ``drain_steps``, each write of it retried (read and
        decided again) on a 409.
        """
        for attempt in range(self.drain.conflict_retries + 1 if self.drain else 1):
            try:
                return self._follow_once(spec)
            except _Conflict:
                logger.info(
                    "deployment %s/%s changed meanwhile (409, try %d)",
                    self.namespace,
                    spec.name,
                    attempt + 1,
                )
        raise RuntimeError(f"deployment {spec.name}: too many conflicts")

    def _follow_once(self, spec: PoolSpec) -> FollowAction:
        manifest = render_deployment(namespace=self.namespace, spec=spec)
        name: str = manifest["metadata"]["name"]
        live = self._read_deployment(name)
        metadata = _field(live, "metadata")
        annotations = _field(metadata, "annotations") or {}
        live_replicas = _field(_field(live, "spec"), "replicas")
        action = follow_action(
            manifest,
            existing_digest=annotations.get(SPEC_DIGEST_ANNOTATION),
            existing_replicas=live_replicas,
            is_present=live is not None,
        )
        action = self._write(
            manifest, action, live_replicas, drained=self.drain is not None
        )
        if action in (FollowAction.SCALE, FollowAction.NONE) and self.drain:
            version = _read(metadata, "resourceVersion")
            scaled = self._drain_tick(spec, live_replicas or 0, version)
            action = FollowAction.SCALE if scaled else FollowAction.NONE
        if action != FollowAction.NONE:
            logger.info(
                "%s deployment %s/%s (replicas %d)",
                action,
                self.namespace,
                name,
                spec.replicas,
            )
        return action

    def _read_deployment(self, name: str) -> Any:
        """Return the live Deployment ``name``, or None when there is none."""
        try:
            return self.api.read_namespaced_deployment(
                name=name, namespace=self.namespace
            )
        except Exception as exc:
            if _status(exc) != 404:
                raise
            return None

    def _write(
        self,
        manifest: dict[str, Any],
        action: FollowAction,
        live_replicas: Any,
        *,
        drained: bool,
    ) -> FollowAction:
        """Create or patch the Deployment as ``action`` says; return what was done.

        With ``drained``, a patch leaves the count to the next tick's drain when it
        would lower it, and a scale is the drain's to make; without, a scale
        patches the count at once.
        """
        name: str = manifest["metadata"]["name"]
        if action == FollowAction.CREATE:
            try:
                self.api.create_namespaced_deployment(
                    namespace=self.namespace, body=manifest
                )
            except Exception as exc:
                if _status(exc) != 409:
                    raise
                action = FollowAction.PATCH
        if action == FollowAction.PATCH:
            if drained and (live_replicas or 0) > (manifest["spec"]["replicas"]):
                # Down only through the drain: a whole patch would let the
                # controller pick the pod.
                manifest["spec"]["replicas"] = live_replicas
            self.api.patch_namespaced_deployment(
                name=name, namespace=self.namespace, body=manifest
            )
        elif action == FollowAction.SCALE and not drained:
            self.scale_pool(name, manifest["spec"]["replicas"])
        return action

    def pool_facts(self, spec: PoolSpec, replicas: int, *, now: float) -> PoolFacts:
        """Return the facts ``drain_steps`` decides on: the pods and their replicas."""
        assert self.core is not None and self.ledger is not None
        assert self.drain is not None
        listed = self.core.list_namespaced_pod(
            namespace=self.namespace, label_selector=_selector(spec)
        )
        pods = [_pod_view(item) for item in _field(listed, "items") or []]
        loads = self.ledger.loads([p.pod for p, _ in pods])
        hashes = {h for p, h in pods if not p.is_terminating}
        return PoolFacts(
            replicas=replicas,
            target=spec.replicas,
            pods=tuple(_with_load(p, loads.get(p.pod)) for p, _ in pods),
            now=now,
            drain_timeout_s=self.drain.drain_timeout_s,
            settle_s=self.drain.settle_s,
            is_rolling_out=len(hashes) > 1,
        )

    def _drain_tick(self, spec: PoolSpec, replicas: int, version: str | None) -> bool:
        """Perform one tick of ``drain_steps``; return whether it scaled."""
        now = self.clock()
        steps = drain_steps(self.pool_facts(spec, replicas, now=now))
        scaled = False
        answer: bool | None = None
        while True:
            try:
                effect = next(steps) if answer is None else steps.send(answer)
            except StopIteration as stop:
                decision: Decision = stop.value
                break
            answer = self._perform(spec.name, effect, version)
            scaled = scaled or (isinstance(effect, Scale) and answer)
        if decision.step != Step.CONVERGED:
            logger.info(
                "deployment %s/%s: %s %s",
                self.namespace,
                spec.name,
                decision.step,
                decision.pod or "",
            )
        return scaled

    def _perform(self, name: str, effect: Effect, version: str | None) -> bool:
        """Perform one effect on the API and the ledger; return whether it was done."""
        assert self.core is not None and self.ledger is not None
        try:
            if isinstance(effect, Scale):
                self.scale_pool(name, effect.replicas, resource_version=version)
            elif isinstance(effect, AnnotatePod):
                cost = str(effect.cost) if effect.cost else None  # 0: the default
                self._annotate(effect.pod, {DELETION_COST_ANNOTATION: cost})
            elif isinstance(effect, MarkDraining):
                if not self.ledger.mark_draining(effect.replica_id):
                    return False
                # The stamp after the ledger: a pod stamped draining is out of
                # the rings; a restart re-reads the deadline from it.
                self._annotate(effect.pod, {DRAINING_SINCE_ANNOTATION: f"{effect.at}"})
            else:
                self._annotate(effect.pod, {DRAINING_SINCE_ANNOTATION: None})
                return self.ledger.mark_serving(effect.replica_id)
        except Exception as exc:
            if _status(exc) == 409:
                raise _Conflict from exc
            if _status(exc) == 404 and not isinstance(effect, Scale):
                return False  # the pod is gone meanwhile
            raise
        return True

    def _annotate(self, pod: str, annotations: dict[str, str | None]) -> None:
        assert self.core is not None
        self.core.patch_namespaced_pod(
            name=pod,
            namespace=self.namespace,
            body={"metadata": {"annotations": annotations}},
        )

    def follow_warm(self, spec: PoolSpec, replicas: int) -> FollowAction:
        """Bring the pool's warm-node placeholders (``k8s_warm``) to ``replicas``.

        No drain: a placeholder serves nothing. A pool that asks for none and has
        no placeholder Deployment gets none (0 is not worth an object).
        """
        manifest = render_warm_nodes(
            namespace=self.namespace, spec=spec, replicas=replicas
        )
        name: str = manifest["metadata"]["name"]
        live = self._read_deployment(name)
        if live is None and replicas == 0:
            return FollowAction.NONE
        annotations = _field(_field(live, "metadata"), "annotations") or {}
        live_replicas = _field(_field(live, "spec"), "replicas")
        action = follow_action(
            manifest,
            existing_digest=annotations.get(SPEC_DIGEST_ANNOTATION),
            existing_replicas=live_replicas,
            is_present=live is not None,
        )
        action = self._write(manifest, action, live_replicas, drained=False)
        if action != FollowAction.NONE:
            logger.info(
                "%s deployment %s/%s (warm nodes %d)",
                action,
                self.namespace,
                name,
                replicas,
            )
        return action

    def delete_pool(self, name: str) -> bool:
        """Delete the Deployment; return False if it was already gone."""
        try:
            self.api.delete_namespaced_deployment(name=name, namespace=self.namespace)
        except Exception as exc:
            if _status(exc) != 404:
                raise
            return False
        logger.info("deleted deployment %s/%s", self.namespace, name)
        return True


def _field(obj: Any, name: str) -> Any:
    """Return ``obj[name]`` of a dict, or ``obj.name`` of a client model; None if absent.

    The official client returns models (``V1Deployment``); a dict stands in for
    one in tests and in callers that read the API's JSON. The names used here
    (metadata, annotations, spec, replicas) are the same in both spellings.
    """
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _read(obj: Any, name: str) -> Any:
    """Return a field by its API name (``creationTimestamp``) from a dict, or by
    the client model's (``creation_timestamp``); None if absent."""
    if isinstance(obj, Mapping) or obj is None:
        return _field(obj, name)
    return _field(obj, re.sub(r"([A-Z])", r"_\1", name).lower())


def _epoch(value: Any) -> float | None:
    """Return a timestamp (RFC 3339 text or ``datetime``) as seconds since the epoch."""
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return float(value.timestamp())


def list_pod_facts(core: CoreV1Like, namespace: str, spec: PoolSpec) -> list[PodFacts]:
    """List the pool's pods by its Deployment's selector labels."""
    listed = core.list_namespaced_pod(
        namespace=namespace, label_selector=_selector(spec)
    )
    return [pod_facts(item) for item in _field(listed, "items") or []]


def _selector(spec: PoolSpec) -> str:
    return ",".join(f"{k}={v}" for k, v in pool_labels(spec).items())


def pod_facts(pod: Any) -> PodFacts:
    """Return what ``plan_pod_replicas`` reads of a listed pod (a client model or
    the API's JSON as a dict)."""
    metadata = _read(pod, "metadata")
    status = _read(pod, "status")
    conditions = _read(status, "conditions") or []
    # The client model spells it pod_ip, which _read's camel-to-snake misses.
    pod_ip = (
        status.get("podIP") if isinstance(status, Mapping) else _read(status, "pod_ip")
    )
    annotations = _read(metadata, "annotations") or {}
    return PodFacts(
        name=str(_read(metadata, "name")),
        phase=str(_read(status, "phase") or ""),
        is_ready=any(
            _read(c, "type") == "Ready" and _read(c, "status") == "True"
            for c in conditions
        ),
        pod_ip=pod_ip or None,
        node=str(_read(_read(pod, "spec"), "nodeName") or ""),
        is_terminating=_read(metadata, "deletionTimestamp") is not None,
        annotations=dict(annotations),
    )


def _pod_view(pod: Any) -> tuple[PodView, str]:
    """Return a pod as the drain sees it (its replica: so far unknown), and its
    ``pod-template-hash`` (two of them: a rollout is moving the pool)."""
    facts = pod_facts(pod)
    metadata = _read(pod, "metadata")
    annotations = facts.annotations or {}
    labels = _read(metadata, "labels") or {}
    is_ready = facts.is_ready and facts.phase == "Running"
    since = annotations.get(DRAINING_SINCE_ANNOTATION)
    try:
        cost = int(annotations.get(DELETION_COST_ANNOTATION, 0))
    except ValueError:
        cost = 0
    view = PodView(
        pod=facts.name,
        replica_id=facts.name,
        state=ReplicaState.SERVING if is_ready else ReplicaState.STARTING,
        is_ready=is_ready,
        is_terminating=facts.is_terminating,
        # Unknown until the ledger says: never taken for zero.
        streams=None,
        created_at=_epoch(_read(metadata, "creationTimestamp")) or 0.0,
        draining_since=float(since) if since else None,
        deletion_cost=cost,
    )
    return view, str(labels.get("pod-template-hash", ""))


def _with_load(pod: PodView, load: ReplicaLoad | None) -> PodView:
    """Return ``pod`` with its replica's state and streams from the ledger."""
    state = pod.state if load is None else load.state
    if pod.draining_since is not None:
        state = ReplicaState.DRAINING
    elif not pod.is_ready:
        state = ReplicaState.STARTING
    return replace(
        pod,
        state=state,
        streams=None if load is None else load.streams,
        tokens_in_flight=0 if load is None else load.tokens_in_flight,
    )


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None
